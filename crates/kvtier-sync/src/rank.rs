//! Every lock's rank: the one lock order of the store, the server and the
//! cluster node, in one table. A thread holding locks may take another only if its rank is
//! above all of theirs; nothing is taken while a leaf is held.

use std::fmt;

/// The rank of a lock. Declared in the order locks may be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rank {
    /// A sequence's lock (`catalog`): read for reads, write for changes.
    /// One sequence's at a time.
    Sequence,
    /// The map of sequences (`catalog`): held only to find, add or remove
    /// one (a drop removes its sequence while holding its lock).
    Sequences,
    /// The physical page table (`catalog`): bookkeeping only.
    PageTable,
    /// The host cache's migration lock (`host/`): held across one
    /// migration's NVMe writes, so that a second allocation waits for the
    /// first one's room.
    HostMigration,
    /// A physical page's placement (`page/`), one at a time.
    Placement,
    /// The page id allocator (`durability/ids.rs`).
    PageIds,
    /// The journal's file (`durability/journal.rs`): records about a page
    /// are appended under its placement lock, so the journal orders them
    /// as the changes happened.
    JournalFile,
    /// The journal's record buffer.
    JournalPending,
    // Leaves: held alone for one update, nothing taken under them.
    /// The host cache's LRU (`page/lru.rs`): under the frequency policy,
    /// its small queue.
    HostLru,
    /// The host cache's main queue under the frequency policy
    /// (`host/mod.rs`).
    HostMain,
    /// The pages the host's background round due migrates, chosen where
    /// it fell due (`host/mod.rs`).
    HostRound,
    /// The device cache's LRU (the loop policy's stream region).
    DeviceLru,
    /// The loop policy's resident subset (`device/policy.rs`).
    DeviceResident,
    /// The loop policy's last selection per (sequence, layer).
    DeviceLastChosen,
    /// A lane's last ranking, kept for reuse across decode steps
    /// (`catalog/sequence.rs`).
    LaneLastRanking,
    /// Changes left for a sequence's next writer by the sketch sweep and
    /// by rankings (`catalog`'s `Sequence::deferred`).
    DeferredWrites,
    /// The sketches one lane's ranking read back (`reader/sketches.rs`).
    DerivedSketches,
    /// The tenants' accounts (`accounts/`).
    Tenants,
    /// Page leases (`lease.rs`).
    Leases,
    /// The device workers' job queue (`device/workers.rs`).
    WorkerQueue,
    /// The access trace's current recorder (`access_trace.rs`).
    TraceRecorder,
    /// The access trace's writer thread handle.
    TraceWriter,
    /// The last finished trace's status.
    TraceStatus,
    /// The server's shared-memory regions by id (`shm/mod.rs`).
    ShmRegions,
    /// One region's busy windows.
    ShmWindows,
    /// The server's shared-memory connection threads (`shm/calls.rs`).
    ShmConnections,
    /// The server's admission gate (`gate.rs`).
    Gate,
    /// A cluster node's state (`kvtier-cluster`'s `node.rs`).
    NodeState,
    /// A cluster node's leases.
    NodeLeases,
    /// When a cluster node's lease was last renewed.
    NodeRenewed,
    /// The sequences a cluster node owns.
    NodeOwned,
    /// The sequences a cluster node is moving, and the calls in flight for
    /// them (`kvtier-server`'s `moves/gate.rs`).
    Moves,
    /// A node's channels to other nodes (`kvtier-server`'s `moves/peers.rs`).
    Peers,
}

impl Rank {
    /// Held alone: taking any lock while holding a leaf panics.
    pub fn is_leaf(self) -> bool {
        self >= Rank::HostLru
    }
}

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}
