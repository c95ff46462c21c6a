//! Unit tests of placement: weights, the placer's balance, replicas,
//! relays, moves, and the host layout.

use super::*;

fn servers(colocated: &[bool], threads: usize) -> Vec<ServerInfo> {
    colocated
        .iter()
        .enumerate()
        .map(|(i, &c)| ServerInfo {
            rank: i as u32,
            addr: format!("10.0.0.{i}"),
            ports: (0..threads as u16).map(|p| 9000 + p).collect(),
            colocated: c,
            host: format!("h{i}"),
            rack: 0,
        })
        .collect()
}

#[test]
fn weights_match_byteps_formula() {
    // n = 4 workers, k = 2 CPU-only, 4 colocated: M_cpu/M_gpu = 2(n-1)/(n-k) = 3.
    let w = server_weights(&[false, false, true, true, true, true], 4);
    assert_eq!(w, vec![6.0, 6.0, 2.0, 2.0, 2.0, 2.0]);
    // Shares: k*M_cpu + n*M_gpu = M with M_cpu = 2(n-1)M/(n^2+kn-2k).
    let (n, k) = (4.0f64, 2.0f64);
    let total: f64 = w.iter().sum();
    assert!((w[0] / total - 2.0 * (n - 1.0) / (n * n + k * n - 2.0 * k)).abs() < 1e-12);
    assert!((w[2] / total - (n - k) / (n * n + k * n - 2.0 * k)).abs() < 1e-12);
    // All colocated -> equal (all-reduce-equivalent); all CPU-only -> equal (sharded PS).
    assert_eq!(server_weights(&[true; 3], 3), vec![3.0; 3]);
    assert_eq!(server_weights(&[false; 2], 3), vec![4.0; 2]);
    // k >= n: colocated servers get nothing.
    assert_eq!(server_weights(&[false, false, true], 2), vec![2.0, 2.0, 0.0]);
    // A single worker: evenly.
    assert_eq!(server_weights(&[false, true], 1), vec![1.0, 1.0]);
}

#[test]
fn placement_is_deterministic_and_balanced() {
    let s = servers(&[false, false, false], 4);
    let sizes: Vec<u64> = (0..1000).map(|i| 1 + (i * 7919 % 65536) as u64).collect();
    let mut a = Placer::new(&s, 4);
    let mut b = Placer::new(&s, 4);
    let pa = a.place(sizes.iter().copied());
    assert_eq!(pa, b.place(sizes.iter().copied()));
    let loads = a.loads();
    let max = *loads.iter().max().unwrap();
    let min = *loads.iter().min().unwrap();
    // Greedy least-loaded keeps the spread below one largest item.
    assert!(max - min <= 65536, "loads {loads:?}");
    assert_eq!(loads.iter().sum::<u64>(), sizes.iter().sum::<u64>());
}

#[test]
fn a_server_that_joins_takes_its_weighted_share_and_only_from_the_others() {
    // 3 CPU-only servers of 2 threads, 4 pushing machines, 2 tensors of
    // 60 and 37 chunks of one size.
    let mut p = Placer::new(&servers(&[false, false, false], 2), 4);
    let mk = |key, numel| crate::protocol::TensorSpec {
        key,
        name: format!("t{key}"),
        numel,
        dtype: crate::protocol::DType::F32,
        chunk_elems: 1000,
        slots: Vec::new(),
        replicas: Vec::new(),
        relays: Vec::new(),
        members: Vec::new(),
    };
    let (mut a, mut b) = (mk(0, 60_000), mk(1, 37_000));
    let chunk = 4000;
    a.slots = p.place((0..60).map(|_| chunk));
    b.slots = p.place((0..37).map(|_| chunk));
    let before = (a.slots.clone(), b.slots.clone());
    // A fourth, CPU-only: the same weight as the others, so a quarter.
    let joined = servers(&[false, false, false, false], 2).remove(3);
    p.add_server(&joined);
    assert_eq!(p.num_slots(), 8);
    let changed = p.rebalance_onto(3, &mut [&mut a, &mut b]);
    assert_eq!(changed, vec![0], "equal chunks: the first tensor's move first");
    assert_eq!(a.slots.iter().filter(|&&s| s >= 6).count(), 24, "a quarter of 97 chunks");
    for (old, new) in [(&before.0, &a.slots), (&before.1, &b.slots)] {
        for (o, n) in old.iter().zip(new) {
            assert!(o == n || *n >= 6, "a chunk moved from slot {o} to {n}, not onto the new server");
        }
    }
    let per_server: Vec<u64> = (0..4).map(|s| p.loads()[2 * s..2 * s + 2].iter().sum()).collect();
    let total: u64 = per_server.iter().sum();
    assert_eq!(total, 97 * chunk);
    for (s, &l) in per_server.iter().enumerate() {
        assert!(l.abs_diff(total / 4) <= 2 * chunk, "server {s} carries {l} of {total}: {per_server:?}");
    }
    // Deterministic: the same placement and join give the same moves.
    let mut q = Placer::new(&servers(&[false, false, false], 2), 4);
    let (mut a2, mut b2) = (mk(0, 60_000), mk(1, 37_000));
    a2.slots = q.place((0..60).map(|_| chunk));
    b2.slots = q.place((0..37).map(|_| chunk));
    q.add_server(&joined);
    q.rebalance_onto(3, &mut [&mut a2, &mut b2]);
    assert_eq!((a2.slots, b2.slots), (a.slots.clone(), b.slots.clone()));
    // A chunk its server keeps goes back, load and all.
    let moved = (0..60).find(|&c| a.slots[c] != before.0[c]).unwrap();
    let to = a.slots[moved] as usize;
    let load = p.loads()[to];
    p.keep(&mut a, moved, before.0[moved]);
    assert_eq!(a.slots[moved], before.0[moved]);
    assert_eq!(p.loads()[to], load - chunk);
}

#[test]
fn a_server_that_joins_takes_small_chunks_when_the_large_ones_would_overload_it() {
    // Each of 3 slots holds one 8000-byte chunk and 8 of 500: a joining
    // server of 2 threads (each half a server's weight) cannot take an
    // 8000-byte chunk without becoming the costliest, but takes small ones.
    let mut p = Placer::new(&servers(&[false, false, false], 1), 4);
    let mut t = crate::protocol::TensorSpec {
        key: 0,
        name: "w".into(),
        numel: 0,
        dtype: crate::protocol::DType::F32,
        chunk_elems: 1,
        slots: Vec::new(),
        replicas: Vec::new(),
        relays: Vec::new(),
        members: Vec::new(),
    };
    let sizes: Vec<u64> = (0..3).map(|_| 8000).chain((0..24).map(|_| 500)).collect();
    t.slots = p.place(sizes.iter().copied());
    let bytes = |p: &Placer| p.loads().to_vec();
    let before = bytes(&p);
    p.add_server(&servers(&[false, false, false, false], 2).remove(3));
    // chunk_bytes() of this spec is 0: move by the sizes placed.
    let mut specs: Vec<crate::protocol::TensorSpec> = sizes
        .iter()
        .zip(&t.slots)
        .enumerate()
        .map(|(i, (&b, &slot))| crate::protocol::TensorSpec {
            key: i as u32,
            name: format!("c{i}"),
            numel: b / 4,
            dtype: crate::protocol::DType::F32,
            chunk_elems: b / 4,
            slots: vec![slot],
            replicas: Vec::new(),
            relays: Vec::new(),
            members: Vec::new(),
        })
        .collect();
    let mut refs: Vec<&mut crate::protocol::TensorSpec> = specs.iter_mut().collect();
    let changed = p.rebalance_onto(3, &mut refs);
    assert!(!changed.is_empty(), "nothing moved: {before:?} -> {:?}", p.loads());
    assert!(changed.iter().all(|&i| sizes[i] == 500), "a large chunk moved: {changed:?}");
    let old_max = *p.loads()[..3].iter().max().unwrap();
    assert!(old_max < 12_000, "the old slots still carry {:?}", p.loads());
}

#[test]
fn a_cpu_only_server_that_joins_changes_the_byteps_split() {
    // Two colocated servers, n = 2 pushing machines: 50 % each; a
    // CPU-only one joins (k = 1): weights 2(n-1) = 2 vs n-k = 1.
    let mut p = Placer::new(&servers(&[true, true], 1), 2);
    let mut t = crate::protocol::TensorSpec {
        key: 0,
        name: "w".into(),
        numel: 40_000,
        dtype: crate::protocol::DType::F32,
        chunk_elems: 1000,
        slots: Vec::new(),
        replicas: Vec::new(),
        relays: Vec::new(),
        members: Vec::new(),
    };
    t.slots = p.place((0..40).map(|_| 4000));
    let joined = servers(&[true, true, false], 1).remove(2);
    p.add_server(&joined);
    p.rebalance_onto(2, &mut [&mut t]);
    let on_new = t.slots.iter().filter(|&&s| s == 2).count();
    assert!((19..=21).contains(&on_new), "the CPU-only server took {on_new} of 40 chunks (half expected)");
    // A second CPU-only server makes k = n = 2: BytePS gives the
    // colocated ones nothing, so every chunk leaves them.
    let joined = servers(&[true, true, false, false], 1).remove(3);
    p.add_server(&joined);
    p.rebalance_onto(3, &mut [&mut t]);
    assert!(t.slots.iter().all(|&s| s >= 2), "chunks left on colocated servers: {:?}", t.slots);
    let on_last = t.slots.iter().filter(|&&s| s == 3).count();
    assert!((19..=21).contains(&on_last), "the second CPU-only server took {on_last} of 40 chunks");
}

#[test]
fn replicas_are_on_another_server_and_take_the_chunks_of_a_lost_one() {
    // Three servers of 2 threads: slot / 2 is the server.
    let mut p = Placer::new(&servers(&[false, false, false], 2), 4).with_replicas(true);
    let mut spec = crate::protocol::TensorSpec {
        key: 0,
        name: "w".into(),
        numel: 300,
        dtype: crate::protocol::DType::F32,
        chunk_elems: 10,
        slots: Vec::new(),
        replicas: Vec::new(),
        relays: Vec::new(),
        members: Vec::new(),
    };
    spec.slots = p.place((0..30).map(|c| spec.chunk_bytes(c) as u64));
    spec.replicas = p.place_replicas(&spec);
    assert_eq!(spec.replicas.len(), 30);
    for c in 0..30 {
        assert_ne!(spec.slots[c] / 2, spec.replicas[c] / 2, "chunk {c}'s replica is on its own server");
    }
    for srv in 0..3 {
        let n = spec.replicas.iter().filter(|&&r| r / 2 == srv).count();
        assert!((8..=12).contains(&n), "server {srv} replicates {n} of 30 chunks");
    }
    let before = spec.clone();
    let gone = p.remove_server(1);
    assert!(p.replace(&mut spec, &gone));
    for c in 0..30 {
        let (s, r) = (spec.slots[c], spec.replicas[c]);
        assert!(s / 2 != 1 && r / 2 != 1, "chunk {c} still uses the lost server: slot {s}, replica {r}");
        assert_ne!(s / 2, r / 2, "chunk {c}'s replica is on its own server");
        if before.slots[c] / 2 == 1 {
            assert_eq!(s, before.replicas[c], "chunk {c} must move to its replica");
        } else {
            assert_eq!(s, before.slots[c], "chunk {c} was not on the lost server");
            if before.replicas[c] / 2 != 1 {
                assert_eq!(r, before.replicas[c], "chunk {c}'s replica was not lost");
            }
        }
    }
    // Load follows the chunks: the promoted replicas' bytes count as placed.
    let placed: u64 = p.loads().iter().sum();
    assert_eq!(placed, 300 * 4);
    // One server left: nowhere to replicate.
    let gone = p.remove_server(2);
    assert!(p.replace(&mut spec, &gone));
    assert!(spec.slots.iter().all(|&s| s / 2 == 0));
    assert!(spec.replicas.is_empty());
    p.unplace(&spec);
    assert_eq!(p.loads().iter().sum::<u64>(), 0);
    // Off: no replicas.
    let mut q = Placer::new(&servers(&[false, false], 1), 2);
    assert!(q.place_replicas(&spec).is_empty());
}

#[test]
fn a_lost_servers_chunks_move_to_the_others_in_proportion() {
    // Two CPU-only servers (2 threads each) and one colocated, 4 pushing machines.
    let mut p = Placer::new(&servers(&[false, false, true], 2), 4);
    let mut spec = crate::protocol::TensorSpec {
        key: 0,
        name: "w".into(),
        numel: 600,
        dtype: crate::protocol::DType::F32,
        chunk_elems: 10,
        slots: Vec::new(),
        replicas: Vec::new(),
        relays: Vec::new(),
        members: Vec::new(),
    };
    spec.slots = p.place((0..60).map(|c| spec.chunk_bytes(c) as u64));
    assert!(spec.slots.iter().any(|&s| s / 2 == 1), "server 1 got chunks");
    let before = spec.slots.clone();
    let gone = p.remove_server(1);
    assert_eq!(gone, vec![2, 3]);
    assert!(p.replace(&mut spec, &gone));
    for (c, (&a, &b)) in before.iter().zip(&spec.slots).enumerate() {
        assert!(b / 2 != 1, "chunk {c} still on the lost server");
        if a / 2 != 1 {
            assert_eq!(a, b, "chunk {c} was not on the lost server and must not move");
        }
    }
    // The survivors keep their weights: CPU-only 2(n-1) = 6 vs colocated n-k = 2.
    let bytes =
        |srv: u32| -> u64 { p.loads().iter().enumerate().filter(|(i, _)| *i as u32 / 2 == srv).map(|(_, &l)| l).sum() };
    assert_eq!(bytes(1), 0);
    assert_eq!(bytes(0) + bytes(2), 2400);
    assert!(bytes(0) >= 2 * bytes(2), "{} vs {}", bytes(0), bytes(2));
    assert!(!p.replace(&mut spec, &gone), "nothing left to move");
    // Only zero-weight servers left: they take the chunks rather than nobody.
    let mut q = Placer::new(&servers(&[true, true], 1), 1);
    assert!(q.place([4, 4, 4, 4]).iter().all(|&s| s < 2));
}

#[test]
fn placement_follows_weights() {
    // n=4, k=1: M_cpu/M_gpu = 6/3 = 2, so server 0 gets twice each colocated one.
    let s = servers(&[false, true, true, true, true], 2);
    let mut p = Placer::new(&s, 4);
    p.place(std::iter::repeat_n(1000u64, 6000));
    let per_server: Vec<u64> = p.loads().chunks(2).map(|c| c.iter().sum()).collect();
    let unit = per_server[1] as f64;
    assert!((per_server[0] as f64 / unit - 2.0).abs() < 0.01, "{per_server:?}");
    for &l in &per_server[1..] {
        assert!((l as f64 / unit - 1.0).abs() < 0.01, "{per_server:?}");
    }
}

fn layout(hosts: &[&str], local: &[u32], reduce: bool) -> Result<HostLayout, String> {
    let h: Vec<String> = hosts.iter().map(|s| s.to_string()).collect();
    HostLayout::new(&h, local, reduce)
}

#[test]
fn host_layout_rotates_owners_within_each_host() {
    // Uneven hosts: a (ranks 0, 2, 3), b (rank 1); local ranks not in rank order.
    let l = layout(&["a", "b", "a", "a"], &[1, 0, 0, 2], true).unwrap();
    assert_eq!(l.num_hosts(), 2);
    assert_eq!(l.host_workers(0), &[2, 0, 3]);
    assert_eq!(l.host_workers(1), &[1]);
    let mut pushed = [0usize; 4];
    for key in 0..5 {
        for chunk in 0..6 {
            let p = l.pushers(key, chunk);
            // One pusher per host, and it is the owner every worker of that host computes.
            assert_eq!(p.len(), 2);
            for r in 0..4 {
                assert!(p.contains(&l.owner(r, key, chunk)));
            }
            assert_eq!(l.owner(0, key, chunk), l.owner(3, key, chunk));
            assert_eq!(l.owner(1, key, chunk), 1);
            for r in p {
                pushed[r as usize] += 1;
            }
        }
    }
    // Host a's 30 chunks split evenly over its three workers; b pushes all.
    assert_eq!(pushed, [10, 30, 10, 10]);
    // Off: every worker is its own host.
    let off = layout(&["a", "b", "a", "a"], &[1, 0, 0, 2], false).unwrap();
    assert_eq!(off.pushers(3, 1), vec![0, 1, 2, 3]);
    assert_eq!(off.owner(2, 3, 1), 2);
    // Inconsistent local ranks are refused, not guessed.
    assert!(layout(&["a", "a"], &[0, 0], true).unwrap_err().contains("share local rank 0"));
    assert!(layout(&["a", "a"], &[0, 2], true).unwrap_err().contains("local rank 2"));
    assert!(layout(&["a"], &[0, 1], true).is_err());
}

#[test]
fn relays_stay_in_their_rack_and_every_rack_pushes_to_the_owner_once() {
    // Servers 0, 1 in rack 0, servers 2, 3 in rack 1, and a CPU-only
    // server 4 in rack 2 without workers; 2 threads each.
    let mut s = servers(&[true, true, true, true, false], 2);
    let racks = [0, 0, 1, 1, 2];
    for (x, &r) in s.iter_mut().zip(&racks) {
        x.rack = r;
    }
    let mut p = Placer::new(&s, 4).with_racks(&racks, vec![true, true, false]);
    let mut spec = crate::protocol::TensorSpec {
        key: 1,
        name: "t".into(),
        numel: 40 * 1024,
        dtype: crate::protocol::DType::F32,
        chunk_elems: 1024,
        slots: Vec::new(),
        replicas: Vec::new(),
        relays: Vec::new(),
        members: Vec::new(),
    };
    spec.slots = p.place((0..40).map(|c| spec.chunk_bytes(c) as u64));
    spec.relays = p.place_relays(&spec);
    assert_eq!(spec.relays.len(), 40 * 3);
    let rack_of = |slot: u32| racks[slot as usize / 2];
    let mut relayed = [0usize; 10];
    for c in 0..40 {
        let owner = spec.slots[c];
        for r in 0..3u32 {
            let to = spec.slot_for(r, c);
            match (rack_of(owner) == r, r) {
                // The owner's rack pushes to the owner; a rack without workers pushes nothing.
                (true, _) | (false, 2) => assert_eq!(to, owner, "chunk {c} rack {r}"),
                (false, _) => {
                    assert_eq!(rack_of(to), r, "chunk {c}: rack {r}'s relay {to} is in another rack");
                    relayed[to as usize] += 1;
                }
            }
        }
    }
    // Relays spread over each rack's threads (none on the CPU-only rack).
    let per: Vec<usize> = relayed.to_vec();
    assert!(per[..8].iter().all(|&n| n > 0), "{per:?}");
    assert_eq!(per[8] + per[9], 0, "{per:?}");
    let (lo, hi) = (per[..8].iter().min().unwrap(), per[..8].iter().max().unwrap());
    assert!(hi - lo <= 2, "uneven relays {per:?}");
    // Taken back, the relay load is freed: the same tensor again gets the same relays.
    p.unplace(&spec);
    let again = p.place_relays(&spec);
    assert_eq!(again, spec.relays);
}

#[test]
fn with_racks_owners_take_their_rack_and_one_relay_per_other_rack() {
    // Racks: hosts a, b in rack 0; host c in rack 1; host d in rack 2.
    let l = layout(&["a", "a", "b", "c", "c", "d"], &[0, 1, 0, 0, 1, 0], true)
        .unwrap()
        .with_racks(&[0, 0, 0, 1, 1, 2], 3)
        .unwrap();
    assert_eq!((l.num_racks(), l.relay_id(0), l.relay_id(2)), (3, 6, 8));
    // The chunk's relay in rack r is slot 10 + r.
    let slot = |r: u32| 10 + r;
    for (key, chunk) in [(0, 0), (1, 0), (4, 7)] {
        let own = |r| l.owner(r, key, chunk);
        // An owner in rack 0: hosts a and b, then the relays of racks 1 and 2.
        assert_eq!(l.pushers_at(key, chunk, 0, false, &slot), vec![own(0), own(2), 17, 18]);
        // A relay of rack 1 takes host c's pusher only.
        assert_eq!(l.pushers_at(key, chunk, 1, true, &slot), vec![own(3)]);
        // Rank 0's push is the one an init round keeps, through its rack's relay elsewhere.
        assert_eq!(l.init_pusher(key, chunk, 0, false, &slot), Some(own(0)));
        assert_eq!(l.init_pusher(key, chunk, 1, false, &slot), Some(16));
        assert_eq!(l.init_pusher(key, chunk, 0, true, &slot), Some(own(0)));
        assert_eq!(l.init_pusher(key, chunk, 1, true, &slot), None);
    }
    // A host's workers in two racks is an error.
    let e = layout(&["a", "a"], &[0, 1], true).unwrap().with_racks(&[0, 1], 2).unwrap_err();
    assert!(e.contains("share a host but not a rack"), "{e}");
}

#[test]
fn chunking() {
    assert_eq!(chunk_elems(4096, 4), 1024);
    assert_eq!(chunk_elems(3, 4), 1);
}

#[test]
fn a_placer_that_counts_the_tensors_placed_before_places_the_next_ones_alike() {
    // A scheduler that restarted rebuilds its placer from the members'
    // specs: the next tensors go where the first placer would have put them.
    let placed = |p: &mut Placer, key: u32, numel: u64| {
        let chunk_elems = 256;
        let n = numel.div_ceil(chunk_elems);
        let mut spec = crate::protocol::TensorSpec {
            key,
            name: format!("t{key}"),
            numel,
            dtype: crate::protocol::DType::F32,
            chunk_elems,
            slots: Vec::new(),
            replicas: Vec::new(),
            relays: Vec::new(),
            members: Vec::new(),
        };
        spec.slots = p.place((0..n as usize).map(|c| {
            let (a, b) = (c as u64 * chunk_elems, ((c as u64 + 1) * chunk_elems).min(numel));
            (b - a) * 4
        }));
        spec.replicas = p.place_replicas(&spec);
        spec
    };
    let make = || Placer::new(&servers(&[false, true, false], 2), 3).with_replicas(true);
    let mut first = make();
    let before: Vec<_> =
        [(0, 1000), (1, 77), (2, 5000), (3, 256)].iter().map(|&(k, n)| placed(&mut first, k, n)).collect();
    let mut again = make();
    for s in &before {
        again.account(s);
    }
    assert_eq!(again.loads(), first.loads());
    for (k, n) in [(4, 3000), (5, 1), (6, 900)] {
        assert_eq!(placed(&mut again, k, n), placed(&mut first, k, n), "tensor {k}");
    }
    // And counting is undone by unplacing.
    for s in &before {
        again.unplace(s);
        first.unplace(s);
    }
    assert_eq!(again.loads(), first.loads());
}

#[test]
fn a_sharded_tensor_puts_each_shard_on_its_reader_s_host() {
    // Servers 0 and 1 colocated on hosts h0 and h1 (2 threads each), server 2 CPU-only;
    // workers 0 and 1 on h0 and h1, worker 2 on a host without a server.
    let s = servers(&[true, true, false], 2);
    let hosts: Vec<String> = ["h0", "h1", "h9"].iter().map(|h| h.to_string()).collect();
    let mut p = Placer::new(&s, 3).with_homes(&hosts, &s);
    // 6 chunks of 10 elements in 3 shards of 20: chunks 0-1 worker 0's, 2-3 worker 1's, 4-5 worker 2's.
    let chunks: Vec<(u64, u64, u64)> = (0..6).map(|c| (c * 10, c * 10 + 10, 40)).collect();
    let reader = |lo: u64, hi: u64| (lo / 20 == (hi - 1) / 20).then_some((lo / 20) as u32);
    let slots = p.place_sharded(chunks.clone(), reader);
    let server = |slot: u32| p.slot(slot).unwrap().server;
    assert_eq!(slots[..4].iter().map(|&x| server(x)).collect::<Vec<_>>(), [0, 0, 1, 1]);
    // Each reader's chunks spread over its server's threads (least loaded first).
    assert_ne!(slots[0], slots[1]);
    assert_ne!(slots[2], slots[3]);
    // Worker 2 has no server on its host: its shard goes by the BytePS split, here to the
    // CPU-only server (weight 4 against 2, and the colocated ones hold the other shards).
    assert_eq!(slots[4..].iter().map(|&x| server(x)).collect::<Vec<_>>(), [2, 2]);
    // A chunk across two shards goes by the split too.
    let mut q = Placer::new(&s, 3).with_homes(&hosts, &s);
    let across = q.place_sharded([(15, 25, 40)], reader);
    let mut r = Placer::new(&s, 3);
    assert_eq!(across, r.place([40]));
}
