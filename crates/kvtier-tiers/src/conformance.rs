//! The conformance suite every tier backend passes. A backend's tests
//! instantiate it with [`tier_conformance_tests!`](crate::tier_conformance_tests),
//! giving a factory from a capacity in bytes to a fresh tier.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::{AlignedBuf, Slot, Tier, TierError};

/// A recognisable byte pattern per (seed, index), so a misplaced copy shows.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn read_all<T: Tier>(tier: &T, slot: &Slot) -> Vec<u8> {
    let mut out = vec![0u8; slot.len() as usize];
    tier.read(slot, 0, &mut out).expect("read back");
    out
}

/// Whole and partial writes read back bit-exact, for odd and large sizes.
pub fn round_trip<T: Tier>(make: impl Fn(u64) -> T) {
    let tier = make(1 << 22);
    let mut slots = Vec::new();
    for (i, len) in [1usize, 63, 64, 65, 4096, 8192, 100_000].into_iter().enumerate() {
        let mut slot = tier.allocate(len as u64).unwrap();
        assert_eq!(slot.len(), len as u64);
        let data = pattern(i as u64, len);
        tier.write(&mut slot, 0, &data).unwrap();
        slots.push((slot, data));
    }
    for (slot, data) in &mut slots {
        // A hint changes nothing.
        tier.prefetch(slot);
        assert_eq!(&read_all(&tier, slot), data);
        if data.len() > 10 {
            let patch = pattern(99, data.len() / 2);
            tier.write(slot, 3, &patch).unwrap();
            data[3..3 + patch.len()].copy_from_slice(&patch);
            assert_eq!(&read_all(&tier, slot), data);
            let mut mid = vec![0u8; 5];
            tier.read(slot, 2, &mut mid).unwrap();
            assert_eq!(mid, data[2..7]);
            // Into memory holding garbage, as a response buffer's spare room does.
            let mut uninit = vec![std::mem::MaybeUninit::new(0xEEu8); data.len() - 1];
            tier.read_uninit(slot, 1, &mut uninit).unwrap();
            // SAFETY: `uninit` was initialised (with garbage, then the read).
            let read: Vec<u8> = uninit.iter().map(|b| unsafe { b.assume_init() }).collect();
            assert_eq!(read, data[1..]);
        }
    }
}

/// The capacity is exact: allocations stop at it with `Full` and nothing
/// is overwritten; freeing makes room again.
pub fn full_tier<T: Tier>(make: impl Fn(u64) -> T) {
    let capacity = 64 * 1024;
    let tier = make(capacity);
    assert_eq!(tier.capacity_bytes(), capacity);
    let mut slots = Vec::new();
    loop {
        match tier.allocate(4000) {
            Ok(mut slot) => {
                let data = pattern(slots.len() as u64, 4000);
                tier.write(&mut slot, 0, &data).unwrap();
                slots.push((slot, data));
                assert!(tier.used_bytes() <= capacity);
            }
            Err(TierError::Full {
                requested,
                free,
                capacity: c,
                ..
            }) => {
                assert_eq!((requested, c), (4000, capacity));
                assert_eq!(free, capacity - tier.used_bytes());
                break;
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!(!slots.is_empty());
    assert!(tier.used_bytes() + 4000 > capacity, "gave up with room left");
    assert_eq!(tier.slots(), slots.len() as u64);
    for (slot, data) in &slots {
        assert_eq!(&read_all(&tier, slot), data, "a full tier must not corrupt pages");
    }
    slots.pop();
    tier.allocate(4000).expect("room after a free");
}

/// Reads and writes outside a slot are refused and change nothing.
pub fn out_of_range<T: Tier>(make: impl Fn(u64) -> T) {
    let tier = make(1 << 16);
    let mut slot = tier.allocate(100).unwrap();
    let mut neighbour = tier.allocate(100).unwrap();
    let data = pattern(1, 100);
    tier.write(&mut slot, 0, &data).unwrap();
    tier.write(&mut neighbour, 0, &data).unwrap();
    for (offset, len) in [(0u64, 101usize), (100, 1), (99, 2), (u64::MAX, 2)] {
        let err = tier.write(&mut slot, offset, &vec![0xAA; len]).unwrap_err();
        assert!(matches!(err, TierError::OutOfBounds { slot_len: 100, .. }), "{err}");
        let err = tier.read(&slot, offset, &mut vec![0; len]).unwrap_err();
        assert!(matches!(err, TierError::OutOfBounds { .. }), "{err}");
        let mut uninit = vec![std::mem::MaybeUninit::new(0u8); len];
        let err = tier.read_uninit(&slot, offset, &mut uninit).unwrap_err();
        assert!(matches!(err, TierError::OutOfBounds { .. }), "{err}");
    }
    assert_eq!(read_all(&tier, &slot), data);
    assert_eq!(read_all(&tier, &neighbour), data);
    assert_eq!(tier.allocate(0).unwrap_err(), TierError::ZeroLength);
}

/// Dropped slots return their bytes; fragments coalesce so the whole
/// capacity can be taken again in one slot.
pub fn free_and_reuse<T: Tier>(make: impl Fn(u64) -> T) {
    let capacity = 1 << 20;
    let tier = make(capacity);
    for round in 0..3u64 {
        let slots: Vec<Slot> = (0..100).map(|i| tier.allocate(1000 + i * 7).unwrap()).collect();
        assert_eq!(tier.slots(), 100);
        // Free in an interleaved order to exercise coalescing both ways.
        let (even, odd): (Vec<_>, Vec<_>) = slots.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
        drop(odd);
        drop(even);
        assert_eq!((tier.used_bytes(), tier.slots()), (0, 0), "round {round}");
        let mut all = tier.allocate(capacity).expect("whole capacity after frees");
        tier.write(&mut all, capacity - 1, &[7]).unwrap();
    }
}

/// A slot from another tier instance is refused.
pub fn foreign_slot<T: Tier>(make: impl Fn(u64) -> T) {
    let (a, b) = (make(1 << 16), make(1 << 16));
    let mut slot = a.allocate(64).unwrap();
    assert_eq!(b.write(&mut slot, 0, &[1]).unwrap_err(), TierError::ForeignSlot);
    assert_eq!(b.read(&slot, 0, &mut [0]).unwrap_err(), TierError::ForeignSlot);
    b.prefetch(&slot);
}

/// Threads allocating, writing, reading and freeing at once never see each
/// other's bytes, and every byte comes back at the end.
pub fn concurrent_readers_and_writers<T: Tier + 'static>(make: impl Fn(u64) -> T) {
    let tier = Arc::new(make(8 << 20));
    let workers: Vec<_> = (0..4u64)
        .map(|t| {
            let tier = Arc::clone(&tier);
            thread::spawn(move || {
                let mut held: Vec<(Slot, Vec<u8>)> = Vec::new();
                for i in 0..400u64 {
                    if held.len() >= 48 {
                        let (slot, data) = held.swap_remove(0);
                        assert_eq!(read_all(&*tier, &slot), data);
                    }
                    let len = 512 + ((t * 131 + i * 17) % 8192) as usize;
                    let mut slot = tier.allocate(len as u64).unwrap();
                    let data = pattern(t << 32 | i, len);
                    tier.write(&mut slot, 0, &data).unwrap();
                    held.push((slot, data));
                    if i % 3 == 0 {
                        let (slot, data) = held.swap_remove((i as usize * 7) % held.len());
                        assert_eq!(read_all(&*tier, &slot), data);
                    }
                    for (slot, data) in held.iter().rev().take(4) {
                        assert_eq!(&read_all(&*tier, slot), data);
                    }
                }
                // Dropping what is still held must return its bytes.
                drop(held);
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    assert_eq!((tier.used_bytes(), tier.slots()), (0, 0));
}

/// Owned-buffer batches round-trip bit-exact.
pub fn owned_batches<T: Tier>(make: impl Fn(u64) -> T) {
    let tier = make(1 << 22);
    let lens = [100usize, 4096, 5000, 8192, 30_000];
    let writes: Vec<(Slot, AlignedBuf)> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            (
                tier.allocate(len as u64).unwrap(),
                AlignedBuf::copy_of(&pattern(40 + i as u64, len)),
            )
        })
        .collect();
    let slots: Vec<Arc<Slot>> = tier
        .write_many(writes)
        .into_iter()
        .map(|c| {
            let done = c.wait().expect("completed");
            done.result.expect("write");
            Arc::new(done.slot)
        })
        .collect();
    let reads = slots
        .iter()
        .map(|s| (Arc::clone(s), AlignedBuf::zeroed(s.reserved() as usize)))
        .collect();
    for (i, c) in tier.read_many(reads).into_iter().enumerate() {
        let done = c.wait().expect("completed");
        done.result.expect("read");
        assert_eq!(&done.buf[..], &pattern(40 + i as u64, lens[i])[..]);
    }
}

/// Dropping completions before the I/O finishes is safe: the operations
/// keep their slots and buffers until done, then everything is freed, and
/// the tier keeps working.
pub fn drop_before_completion<T: Tier>(make: impl Fn(u64) -> T) {
    let tier = make(1 << 24);
    for round in 0..4u64 {
        let writes: Vec<(Slot, AlignedBuf)> = (0..64)
            .map(|i| {
                (
                    tier.allocate(8192).unwrap(),
                    AlignedBuf::copy_of(&pattern(round * 100 + i, 8192)),
                )
            })
            .collect();
        drop(tier.write_many(writes));
        let keep = Arc::new(tier.allocate(8192).unwrap());
        let reads = (0..64).map(|_| (Arc::clone(&keep), AlignedBuf::zeroed(8192))).collect();
        drop(tier.read_many(reads));
        drop(keep);
        let deadline = Instant::now() + Duration::from_secs(20);
        while tier.slots() > 0 {
            assert!(
                Instant::now() < deadline,
                "slots of abandoned operations were never freed"
            );
            thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(tier.used_bytes(), 0);
    }
    let mut slot = tier.allocate(8192).unwrap();
    tier.write(&mut slot, 0, &pattern(9, 8192)).unwrap();
    assert_eq!(read_all(&tier, &slot), pattern(9, 8192));
}

/// Instantiates the whole suite as `#[test]`s in a module named `$name`.
/// With `skip = expr` (an `Option<String>` reason), every test prints the
/// reason and returns when it is `Some`; attributes after it (`#[ignore =
/// "..."]`, under a `cfg_attr`) go on every test.
#[macro_export]
macro_rules! tier_conformance_tests {
    ($name:ident, $make:expr) => {
        $crate::tier_conformance_tests!($name, $make, skip = None::<String>);
    };
    ($name:ident, $make:expr, skip = $skip:expr $(, #[$attr:meta])* $(,)?) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            use $crate::conformance as c;
            fn skipped() -> bool {
                let reason: Option<String> = $skip;
                if let Some(reason) = &reason {
                    println!("skipped: {reason}");
                }
                reason.is_some()
            }
            $(#[$attr])*
            #[test]
            fn round_trip() {
                if !skipped() {
                    c::round_trip($make);
                }
            }
            $(#[$attr])*
            #[test]
            fn full_tier() {
                if !skipped() {
                    c::full_tier($make);
                }
            }
            $(#[$attr])*
            #[test]
            fn out_of_range() {
                if !skipped() {
                    c::out_of_range($make);
                }
            }
            $(#[$attr])*
            #[test]
            fn free_and_reuse() {
                if !skipped() {
                    c::free_and_reuse($make);
                }
            }
            $(#[$attr])*
            #[test]
            fn foreign_slot() {
                if !skipped() {
                    c::foreign_slot($make);
                }
            }
            $(#[$attr])*
            #[test]
            fn concurrent_readers_and_writers() {
                if !skipped() {
                    c::concurrent_readers_and_writers($make);
                }
            }
            $(#[$attr])*
            #[test]
            fn owned_batches() {
                if !skipped() {
                    c::owned_batches($make);
                }
            }
            $(#[$attr])*
            #[test]
            fn drop_before_completion() {
                if !skipped() {
                    c::drop_before_completion($make);
                }
            }
        }
    };
}
