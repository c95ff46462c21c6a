//! Raw-TCP baselines for `gradhub bench core`, in the same compiled language
//! as the data plane so the comparison is about protocol, not interpreter: a
//! streaming echo server, an echo client that measures goodput, and a
//! ping-pong client that measures round-trip latency. Standard library only.
//!
//! ```text
//! cargo build --release --example tcp_baseline
//! tcp_baseline echo-serve HOST:PORT                    # prints the bound port, echoes one connection
//! tcp_baseline echo-goodput HOST:PORT NBYTES REPS      # one line per repetition: seconds
//! tcp_baseline ping-pong HOST:PORT SIZE ITERS          # one line per round trip: seconds
//! ```

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::Instant;

/// Accept one connection and echo everything back until it closes.
fn echo_serve(listener: TcpListener) -> std::io::Result<()> {
    let (mut s, _) = listener.accept()?;
    s.set_nodelay(true)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        s.write_all(&buf[..n])?;
    }
}

/// Send `nbytes` and receive them back, `reps` times; returns the seconds of each repetition.
fn echo_goodput(addr: &str, nbytes: usize, reps: usize) -> std::io::Result<Vec<f64>> {
    let s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let src = vec![1u8; nbytes];
    let mut dst = vec![0u8; nbytes];
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        std::thread::scope(|sc| -> std::io::Result<()> {
            let mut w = s.try_clone()?;
            let src = &src;
            let sender = sc.spawn(move || w.write_all(src));
            (&s).read_exact(&mut dst)?;
            sender.join().map_err(|_| std::io::Error::other("sender panicked"))??;
            Ok(())
        })?;
        times.push(t0.elapsed().as_secs_f64());
    }
    Ok(times)
}

/// Round trips of `size` bytes; returns the seconds of each.
fn ping_pong(addr: &str, size: usize, iters: usize) -> std::io::Result<Vec<f64>> {
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let out = vec![1u8; size];
    let mut back = vec![0u8; size];
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t0 = Instant::now();
        s.write_all(&out)?;
        s.read_exact(&mut back)?;
        times.push(t0.elapsed().as_secs_f64());
    }
    Ok(times)
}

const USAGE: &str = "usage: tcp_baseline echo-serve HOST:PORT
       tcp_baseline echo-goodput HOST:PORT NBYTES REPS
       tcp_baseline ping-pong HOST:PORT SIZE ITERS";

fn number(s: &str, what: &str) -> Result<usize, String> {
    s.parse().map_err(|_| format!("{what} must be a non-negative integer, not '{s}'"))
}

fn print_times(times: &[f64]) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    for t in times {
        writeln!(out, "{t}").map_err(|e| e.to_string())?;
    }
    out.flush().map_err(|e| e.to_string())
}

fn run(args: &[String]) -> Result<(), String> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["echo-serve", bind] => {
            let l = TcpListener::bind(bind).map_err(|e| format!("bind {bind}: {e}"))?;
            let port = l.local_addr().map_err(|e| e.to_string())?.port();
            println!("{port}");
            std::io::stdout().flush().map_err(|e| e.to_string())?;
            echo_serve(l).map_err(|e| e.to_string())
        }
        ["echo-goodput", addr, nbytes, reps] => {
            let times = echo_goodput(addr, number(nbytes, "NBYTES")?, number(reps, "REPS")?)
                .map_err(|e| format!("{addr}: {e}"))?;
            print_times(&times)
        }
        ["ping-pong", addr, size, iters] => {
            let times =
                ping_pong(addr, number(size, "SIZE")?, number(iters, "ITERS")?).map_err(|e| format!("{addr}: {e}"))?;
            print_times(&times)
        }
        _ => Err(USAGE.to_string()),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tcp_baseline: {e}");
            ExitCode::FAILURE
        }
    }
}
