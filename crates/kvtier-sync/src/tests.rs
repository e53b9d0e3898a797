use std::panic::{AssertUnwindSafe, catch_unwind};

use super::*;

fn panic_message(f: impl FnOnce()) -> Option<String> {
    let err = catch_unwind(AssertUnwindSafe(f)).err()?;
    Some(
        err.downcast_ref::<String>()
            .cloned()
            .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default(),
    )
}

#[test]
fn locks_taken_in_rank_order_pass() {
    let seq = RwLock::new(Rank::Sequence, 0);
    let page = RwLock::new(Rank::Placement, 0);
    let journal = Mutex::new(Rank::JournalFile, 0);
    let lru = Mutex::new(Rank::HostLru, 0);
    let _s = seq.write();
    let _p = page.read();
    let _j = journal.lock();
    drop((_j, _p));
    // Released ranks are free to take again.
    let _p = page.write();
    drop(_p);
    drop(_s);
    let _l = lru.lock();
}

#[test]
#[cfg(debug_assertions)]
fn two_locks_out_of_order_panic() {
    let seq = RwLock::new(Rank::Sequence, 0);
    let page = RwLock::new(Rank::Placement, 0);
    let message = panic_message(|| {
        let _p = page.write();
        let _s = seq.read();
    })
    .expect("taking a sequence's lock under a page's panics");
    assert!(message.contains("Sequence taken while Placement is held"), "{message}");
    // The panic released what it held: the right order works after it.
    let _s = seq.read();
    let _p = page.write();
}

#[test]
#[cfg(debug_assertions)]
fn two_locks_of_one_rank_panic() {
    let a = RwLock::new(Rank::Placement, 0);
    let b = RwLock::new(Rank::Placement, 0);
    let message = panic_message(|| {
        let _a = a.read();
        let _b = b.read();
    })
    .expect("two page locks at once panic");
    assert!(message.contains("Placement taken while Placement is held"), "{message}");
}

#[test]
#[cfg(debug_assertions)]
fn nothing_is_taken_under_a_leaf() {
    let lru = Mutex::new(Rank::HostLru, 0);
    let gate = Mutex::new(Rank::Gate, 0);
    let message = panic_message(|| {
        let _l = lru.lock();
        let _g = gate.lock();
    })
    .expect("a lock under a leaf panics");
    assert!(message.contains("leaf HostLru"), "{message}");
}

#[test]
fn a_condvar_wait_keeps_the_rank_held() {
    let m = std::sync::Arc::new(Mutex::new(Rank::WorkerQueue, false));
    let cv = std::sync::Arc::new(Condvar::new());
    let (m2, cv2) = (std::sync::Arc::clone(&m), std::sync::Arc::clone(&cv));
    let t = std::thread::spawn(move || {
        *m2.lock() = true;
        cv2.notify_all();
    });
    let mut g = m.lock();
    while !*g {
        g = cv.wait(g);
    }
    drop(g);
    t.join().unwrap();
    // Released after the wait: taken again without complaint.
    drop(m.lock());
}
