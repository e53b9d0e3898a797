//! Calls against sequences that are moving between nodes. Every store call
//! for a sequence in a cluster enters here first and holds a [`Permit`]
//! while it runs, so that a move knows which calls are in flight:
//!
//! | phase (this node) | reads | writes |
//! |---|---|---|
//! | none | run | run |
//! | sending to N | run | wait for the move |
//! | committing to N | wait for the outcome | wait |
//! | moved to N | sent to N | sent to N |
//! | receiving from N | sent to N | sent to N |
//!
//! A move starts sending only once no write is in flight, and gives its
//! copy up only once no read is: a read either ran before the commit (it
//! saw what the copy holds, since no write ran meanwhile) or runs at the
//! new owner. Waits are bounded; a call that waited too long is refused
//! UNAVAILABLE, and the client retries.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_cluster::Refusal;
use kvtier_core::SequenceKey;
use kvtier_sync::{Condvar, Mutex, MutexGuard, Rank};

/// How long a call waits for a move before it is refused.
pub(crate) const CALL_WAIT: Duration = Duration::from_secs(30);
/// How long a moved sequence's marker answers calls that raced the move
/// (after that, its ownership record does).
const MOVED_KEPT: Duration = Duration::from_secs(300);

/// A node at the other end of a move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Peer {
    pub(crate) node_id: String,
    /// Where clients reach it (refusals send them there).
    pub(crate) addr: String,
    /// Where this node reaches it.
    pub(crate) peer_addr: String,
}

impl Peer {
    pub(crate) fn of(node: &kvtier_cluster::NodeRecord) -> Self {
        Self {
            node_id: node.node_id.clone(),
            addr: node.addr.clone(),
            peer_addr: node.peer_addr().to_owned(),
        }
    }
}

#[derive(Debug, Clone)]
enum Phase {
    Sending(Peer),
    Committing(Peer),
    Moved(Peer, Instant),
    Receiving(Peer),
}

#[derive(Debug, Default)]
struct Entry {
    readers: u32,
    writers: u32,
    phase: Option<Phase>,
}

impl Entry {
    fn idle(&self) -> bool {
        self.readers == 0 && self.writers == 0 && self.phase.is_none()
    }
}

/// What a call does to its sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Reads it (fetches, selections without an append, describing it).
    Read,
    /// Changes it (writes, transitions, policies, drops).
    Write,
}

/// The moves of one node, and the calls in flight for sequences.
#[derive(Debug)]
pub(crate) struct Moves {
    /// This node's id, for refusals.
    node: String,
    /// How long a call waits for a move.
    wait: Duration,
    table: Mutex<HashMap<SequenceKey, Entry>>,
    changed: Condvar,
}

/// A call in flight for a sequence; the sequence cannot move under it.
#[derive(Debug)]
pub(crate) struct Permit {
    moves: Arc<Moves>,
    key: SequenceKey,
    access: Access,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut table = self.moves.table.lock();
        if let Some(entry) = table.get_mut(&self.key) {
            match self.access {
                Access::Read => entry.readers -= 1,
                Access::Write => entry.writers -= 1,
            }
            if entry.idle() {
                table.remove(&self.key);
            }
        }
        drop(table);
        self.moves.changed.notify_all();
    }
}

impl Moves {
    /// The moves of node `node`, whose calls wait at most `wait` for one.
    pub(crate) fn new(node: &str, wait: Duration) -> Self {
        Self {
            node: node.to_owned(),
            wait,
            table: Mutex::new(Rank::Moves, HashMap::new()),
            changed: Condvar::new(),
        }
    }

    /// Enters a call for `key`, waiting while a move forbids it (see the
    /// module's table); blocks, so it runs where store calls may wait.
    pub(crate) fn enter(self: &Arc<Self>, key: &SequenceKey, access: Access) -> Result<Permit, Refusal> {
        let entered = self.enter_by(key, access, Some(Instant::now() + self.wait))?;
        Ok(entered.expect("a call with a deadline waits for its permit"))
    }

    /// As [`Moves::enter`] without waiting: `None` when the call would wait.
    pub(crate) fn try_enter(self: &Arc<Self>, key: &SequenceKey, access: Access) -> Result<Option<Permit>, Refusal> {
        self.enter_by(key, access, None)
    }

    /// Enters, waiting until `deadline` (`None`: not at all).
    fn enter_by(
        self: &Arc<Self>,
        key: &SequenceKey,
        access: Access,
        deadline: Option<Instant>,
    ) -> Result<Option<Permit>, Refusal> {
        let mut table = self.table.lock();
        loop {
            let entry = table.entry(key.clone()).or_default();
            let waiting_for = match (&entry.phase, access) {
                (None, _) | (Some(Phase::Sending(_)), Access::Read) => {
                    match access {
                        Access::Read => entry.readers += 1,
                        Access::Write => entry.writers += 1,
                    }
                    return Ok(Some(Permit {
                        moves: Arc::clone(self),
                        key: key.clone(),
                        access,
                    }));
                }
                (Some(Phase::Moved(to, _)), _) => return Err(self.elsewhere(key, "moved to", to)),
                (Some(Phase::Receiving(from)), _) => return Err(self.elsewhere(key, "on", from)),
                (Some(Phase::Sending(to) | Phase::Committing(to)), _) => to.node_id.clone(),
            };
            let Some(deadline) = deadline else { return Ok(None) };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Refusal::Unavailable {
                    this: self.node.clone(),
                    what: "serve the sequence now",
                    why: format!(
                        "it has been moving to node {waiting_for} for {} s; retry",
                        self.wait.as_secs()
                    ),
                });
            }
            table = self.changed.wait_timeout(table, left).0;
        }
    }

    fn elsewhere(&self, key: &SequenceKey, why: &'static str, peer: &Peer) -> Refusal {
        Refusal::Elsewhere {
            sequence: key.sequence.as_str().to_owned(),
            why,
            owner: peer.node_id.clone(),
            addr: peer.addr.clone(),
            this: self.node.clone(),
        }
    }

    /// Starts sending `key` to `to`: new writes wait from now on, and this
    /// returns once none is in flight (blocking; at most `limit`). Refused
    /// when the sequence is already moving.
    pub(crate) fn begin_send(&self, key: &SequenceKey, to: &Peer, limit: Duration) -> Result<(), String> {
        let mut table = self.table.lock();
        prune(&mut table);
        let entry = table.entry(key.clone()).or_default();
        if let Some(phase) = &entry.phase {
            return Err(format!("it is moving already ({phase:?})"));
        }
        entry.phase = Some(Phase::Sending(to.clone()));
        let deadline = Instant::now() + limit;
        loop {
            let writers = table.get(key).map_or(0, |e| e.writers);
            if writers == 0 {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                drop(table);
                self.end(key);
                return Err(format!(
                    "{writers} writes were still running after {} s",
                    limit.as_secs()
                ));
            }
            table = self.changed.wait_timeout(table, left).0;
        }
    }

    /// The receiver is taking over: new reads wait too.
    pub(crate) fn begin_commit(&self, key: &SequenceKey) {
        self.set(key, |phase| match phase {
            Some(Phase::Sending(to)) => Some(Phase::Committing(to)),
            other => other,
        });
    }

    /// The receiver took over: every call goes there. Returns once no read
    /// that entered before is in flight (blocking; at most `limit`), so
    /// that the copy here can go.
    pub(crate) fn moved(&self, key: &SequenceKey, limit: Duration) {
        self.set(key, |phase| match phase {
            Some(Phase::Committing(to) | Phase::Sending(to)) => Some(Phase::Moved(to, Instant::now())),
            other => other,
        });
        let deadline = Instant::now() + limit;
        let mut table = self.table.lock();
        while table.get(key).is_some_and(|e| e.readers > 0) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(sequence = %key, "reads of a moved sequence still running; dropping it anyway");
                return;
            }
            table = self.changed.wait_timeout(table, left).0;
        }
    }

    /// Starts receiving `key` from `from`: calls for it here go there.
    /// Refused when the sequence is moving already.
    pub(crate) fn begin_receive(&self, key: &SequenceKey, from: &Peer) -> Result<(), String> {
        let mut table = self.table.lock();
        prune(&mut table);
        let entry = table.entry(key.clone()).or_default();
        match &entry.phase {
            None | Some(Phase::Moved(..)) => {
                entry.phase = Some(Phase::Receiving(from.clone()));
                Ok(())
            }
            Some(phase) => Err(format!("it is moving already ({phase:?})")),
        }
    }

    /// The move of `key` ended here (sent and kept, or received and taken
    /// over, or given up): calls run again.
    pub(crate) fn end(&self, key: &SequenceKey) {
        self.set(key, |_| None);
    }

    /// A sequence created here again after an earlier creation moved away:
    /// the marker of that move answers its calls no more.
    pub(crate) fn end_moved(&self, key: &SequenceKey) {
        self.set(key, |phase| match phase {
            Some(Phase::Moved(..)) => None,
            other => other,
        });
    }

    fn set(&self, key: &SequenceKey, f: impl FnOnce(Option<Phase>) -> Option<Phase>) {
        let mut table = self.table.lock();
        let entry = table.entry(key.clone()).or_default();
        entry.phase = f(entry.phase.take());
        if entry.idle() {
            table.remove(key);
        }
        drop(table);
        self.changed.notify_all();
    }
}

/// Forgets moved sequences' markers once their records answer for them.
fn prune(table: &mut MutexGuard<'_, HashMap<SequenceKey, Entry>>) {
    table.retain(|_, e| {
        !(e.readers == 0
            && e.writers == 0
            && matches!(&e.phase, Some(Phase::Moved(_, at)) if at.elapsed() > MOVED_KEPT))
    });
}

#[cfg(test)]
mod tests;
