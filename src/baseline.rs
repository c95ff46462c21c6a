//! Raw-TCP baselines for the benchmarks, in the same compiled language as
//! the data plane so the comparison is about protocol, not interpreter: a
//! streaming echo server, an echo client that measures goodput, and a
//! ping-pong client that measures round-trip latency.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

/// Accept one connection and echo everything back until it closes.
pub fn echo_serve(listener: TcpListener) -> std::io::Result<()> {
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
pub fn echo_goodput(addr: &str, nbytes: usize, reps: usize) -> std::io::Result<Vec<f64>> {
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
pub fn ping_pong(addr: &str, size: usize, iters: usize) -> std::io::Result<Vec<f64>> {
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
