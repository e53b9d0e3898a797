//! The gate with real threads: what waits, what runs, what is sent away.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use super::*;

fn key(s: &str) -> SequenceKey {
    SequenceKey::parse("t", s).unwrap()
}

fn peer(id: &str) -> Peer {
    Peer {
        node_id: id.into(),
        addr: format!("http://{id}"),
        peer_addr: format!("http://{id}.peers"),
    }
}

/// Runs `f` on a thread; whether it finished within `within`.
fn finishes(within: Duration, f: impl FnOnce() + Send + 'static) -> (thread::JoinHandle<()>, Arc<AtomicBool>) {
    let done = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&done);
    let handle = thread::spawn(move || {
        f();
        flag.store(true, Ordering::SeqCst);
    });
    thread::sleep(within);
    (handle, done)
}

#[test]
fn a_send_waits_for_writes_in_flight_and_holds_new_writes_while_reads_run() {
    let moves = Arc::new(Moves::new("n0", Duration::from_secs(10)));
    let k = key("s");
    let write = moves.enter(&k, Access::Write).unwrap();
    let (m, k2) = (Arc::clone(&moves), k.clone());
    let (sender, started) = finishes(Duration::from_millis(100), move || {
        m.begin_send(&k2, &peer("n1"), Duration::from_secs(5)).unwrap();
    });
    assert!(
        !started.load(Ordering::SeqCst),
        "the send began under a write in flight"
    );
    drop(write);
    sender.join().unwrap();
    // Reads run while it sends; a write waits.
    drop(moves.enter(&k, Access::Read).unwrap());
    let (m, k2) = (Arc::clone(&moves), k.clone());
    let (writer, wrote) = finishes(Duration::from_millis(100), move || {
        let refused = m.enter(&k2, Access::Write).unwrap_err();
        assert!(
            matches!(&refused, Refusal::Elsewhere { owner, why, .. } if owner == "n1" && *why == "moved to"),
            "{refused}"
        );
    });
    assert!(
        !wrote.load(Ordering::SeqCst),
        "a write ran while the sequence was sending"
    );
    moves.begin_commit(&k);
    // A read that arrives while it commits waits for the outcome too.
    let (m, k2) = (Arc::clone(&moves), k.clone());
    let (reader, read) = finishes(Duration::from_millis(100), move || {
        assert!(m.enter(&k2, Access::Read).is_err());
    });
    assert!(!read.load(Ordering::SeqCst), "a read ran while the sequence committed");
    moves.moved(&k, Duration::from_secs(5));
    writer.join().unwrap();
    reader.join().unwrap();
}

#[test]
fn a_moved_sequence_is_given_up_only_after_the_reads_that_entered_before() {
    let moves = Arc::new(Moves::new("n0", Duration::from_secs(10)));
    let k = key("s");
    moves.begin_send(&k, &peer("n1"), Duration::from_secs(1)).unwrap();
    let read = moves.enter(&k, Access::Read).unwrap();
    moves.begin_commit(&k);
    let (m, k2) = (Arc::clone(&moves), k.clone());
    let (mover, gave_up) = finishes(Duration::from_millis(100), move || m.moved(&k2, Duration::from_secs(5)));
    assert!(!gave_up.load(Ordering::SeqCst), "the copy went under a read in flight");
    drop(read);
    mover.join().unwrap();
}

#[test]
fn an_aborted_send_lets_the_waiting_writes_run_here() {
    let moves = Arc::new(Moves::new("n0", Duration::from_secs(10)));
    let k = key("s");
    moves.begin_send(&k, &peer("n1"), Duration::from_secs(1)).unwrap();
    let (m, k2) = (Arc::clone(&moves), k.clone());
    let (writer, _) = finishes(Duration::from_millis(50), move || {
        drop(m.enter(&k2, Access::Write).unwrap())
    });
    moves.end(&k);
    writer.join().unwrap();
    assert!(moves.table.lock().is_empty(), "nothing is left of a move that ended");
}

#[test]
fn a_received_sequence_is_the_senders_until_its_commit_and_waits_are_bounded() {
    let moves = Arc::new(Moves::new("n1", Duration::from_millis(200)));
    let k = key("s");
    moves.begin_receive(&k, &peer("n0")).unwrap();
    let refused = moves.enter(&k, Access::Read).unwrap_err();
    assert!(
        matches!(&refused, Refusal::Elsewhere { owner, .. } if owner == "n0"),
        "{refused}"
    );
    assert!(moves.begin_send(&k, &peer("n2"), Duration::from_secs(1)).is_err());
    moves.end(&k);
    drop(moves.enter(&k, Access::Write).unwrap());
    // A write held by a send that never ends is refused in time.
    moves.begin_send(&k, &peer("n2"), Duration::from_secs(1)).unwrap();
    assert!(
        moves.try_enter(&k, Access::Write).unwrap().is_none(),
        "a write would wait"
    );
    drop(
        moves
            .try_enter(&k, Access::Read)
            .unwrap()
            .expect("a read runs while sending"),
    );
    let refused = moves.enter(&k, Access::Write).unwrap_err();
    assert!(matches!(refused, Refusal::Unavailable { .. }), "{refused}");
    assert!(
        moves.begin_receive(&k, &peer("n2")).is_err(),
        "a sequence sending cannot be received"
    );
}
