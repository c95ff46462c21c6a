//! Round-trip latency of a small push_pull measured from Rust (no Python),
//! with scheduler, one server and one worker in this process.
//! `cargo run --release --example latency [bytes] [iters]`

use std::time::Instant;

use gradhub::client::{Client, ClientConfig};
use gradhub::protocol::DType;
use gradhub::scheduler::{start_scheduler, SchedulerConfig};
use gradhub::server::{run_server, ServerConfig};

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let bytes = args.first().copied().unwrap_or(4096);
    let iters = args.get(1).copied().unwrap_or(5000);
    let sched =
        start_scheduler(SchedulerConfig { bind: "127.0.0.1:0".into(), ..Default::default() }).expect("scheduler");
    let addr = sched.addr.to_string();
    let a2 = addr.clone();
    std::thread::spawn(move || {
        run_server(ServerConfig { scheduler: a2, advertise: Some("127.0.0.1".into()), ..Default::default() })
    });
    let c = Client::connect(ClientConfig { scheduler: addr, ..Default::default() }).expect("client");
    let mut buf = vec![1.0f32; bytes / 4];
    let mut times = Vec::with_capacity(iters);
    for i in 0..iters + 100 {
        let t0 = Instant::now();
        // SAFETY: buf outlives the op, which is waited for right away.
        let op =
            unsafe { c.push_pull(buf.as_mut_ptr() as *mut u8, bytes, DType::F32, "x", 0, 0, None) }.expect("push_pull");
        op.wait(None).expect("wait");
        if i >= 100 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    println!(
        "push_pull {bytes} B from Rust: median {:.1} us, p10 {:.1} us",
        times[iters / 2] * 1e6,
        times[iters / 10] * 1e6
    );
    c.shutdown();
}
