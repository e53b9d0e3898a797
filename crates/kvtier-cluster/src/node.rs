//! A kvtier server's membership: it registers in etcd under two leases,
//! keeps them alive, claims the sequences it creates, and finds out on
//! (re)joining which of the sequences it holds are still its own.
//!
//! Two leases, two meanings:
//! - the **membership** lease (`ttl`, seconds) carries `nodes/<id>`: while
//!   it lives the node is in the cluster and placement may give it keys;
//! - the **grace** lease (`grace`, a minute or more) carries `held/<id>`:
//!   while it lives the node's sequences are its own, even while the node
//!   is out. Past it, another node may take a sequence over (a create of
//!   the same id where placement now puts it), and the node, if it returns,
//!   gives up every sequence it held.
//!
//! The node fences itself, serving no sequence, once it has not renewed the
//! grace lease for half the grace period: etcd cannot have expired it yet,
//! so no sequence has two owners serving it at once.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse};
use kvtier_core::SequenceKey;
use kvtier_core::placement::PlacementKey;
use kvtier_sync::{Mutex, Rank};
use tokio::sync::watch;

use crate::etcd::EtcdConfig;
use crate::keys::Keys;
use crate::record::{Group, NodeRecord, NodeState, OwnerRecord, TierBytes};
use crate::refusal::Refusal;
use crate::view::{self, View};

/// A node's cluster settings.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Where the cluster's etcd is, and the cluster's name.
    pub etcd: EtcdConfig,
    /// This node's id: one live process per id in the cluster.
    pub node_id: String,
    /// The URL other nodes and clients reach this node's gRPC service at.
    pub advertise: String,
    /// The URL other nodes reach it at, where that differs (`None`:
    /// `advertise`).
    pub peer_advertise: Option<String>,
    /// The membership lease: a node silent this long is out.
    pub ttl: Duration,
    /// How long a node that is out keeps its sequences.
    pub grace: Duration,
    /// kvtier's version, published in the node record.
    pub version: String,
    /// Bytes per tier, published in the node record (placement weighs
    /// nodes by it).
    pub capacity: TierBytes,
}

/// What the node holds, as the store knows it.
pub trait LocalSequences: Send + Sync + std::fmt::Debug + 'static {
    /// Every sequence held.
    fn sequences(&self) -> Vec<SequenceKey>;
    /// Gives up a sequence the cluster no longer says is this node's.
    fn forget(&self, key: &SequenceKey);
    /// Free bytes per tier, for the node record.
    fn free(&self) -> TierBytes;
}

/// The node's standing, for health checks and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// etcd reachable, leases renewed.
    Serving,
    /// etcd unreachable: the node serves what it holds, creates nothing.
    Degraded(String),
    /// etcd unreachable for half the grace period: the node serves nothing.
    Fenced(String),
}

#[derive(Debug)]
pub(crate) struct Leases {
    pub(crate) membership: i64,
    pub(crate) grace: i64,
}

/// A node in a cluster.
pub struct Node {
    pub(crate) config: NodeConfig,
    pub(crate) keys: Keys,
    pub(crate) etcd: etcd_client::Client,
    local: Arc<dyn LocalSequences>,
    view: watch::Receiver<Arc<View>>,
    pub(crate) state: Mutex<NodeState>,
    pub(crate) leases: Mutex<Leases>,
    /// When the last grace-lease renewal that etcd answered was sent.
    renewed: Mutex<Instant>,
    health: watch::Sender<Health>,
    incarnations: AtomicU64,
    /// The incarnation of each sequence this node owns (its ownership
    /// record's, cached: calls are checked against it).
    owned: Mutex<HashMap<SequenceKey, u64>>,
    /// Set by [`Node::leave`]: the leases are no longer renewed.
    pub(crate) left: AtomicBool,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("config", &self.config)
            .field("state", &self.state)
            .field("leases", &self.leases)
            .finish_non_exhaustive()
    }
}

/// What joining found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Joined {
    /// Whether the node came back within its grace period (its sequences
    /// are still its own).
    pub within_grace: bool,
    /// Sequences kept.
    pub kept: usize,
    /// Sequences given up: lost past the grace, owned by another node, or
    /// recorded as this node's but not held (created and never persisted
    /// before a crash).
    pub forgotten: usize,
    /// Sequences held without an ownership record (a standalone data
    /// directory), now claimed.
    pub adopted: usize,
}

/// Why [`Node::join`] failed.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// etcd could not be reached, or failed a request joining needs.
    #[error("etcd at {endpoints}: {source}")]
    Etcd {
        /// The configured endpoints, comma-separated.
        endpoints: String,
        /// etcd's error.
        source: etcd_client::Error,
    },
    /// Another live process holds this node id's membership (the id).
    #[error("node {0} is already in the cluster (another process holds its membership)")]
    Duplicate(String),
}

fn secs(d: Duration) -> i64 {
    d.as_secs().max(1) as i64
}

impl Node {
    /// Registers (joining), settles which held sequences are still this
    /// node's, then serves. Fails if etcd cannot be reached.
    pub async fn join(config: NodeConfig, local: Arc<dyn LocalSequences>) -> Result<(Arc<Self>, Joined), JoinError> {
        let endpoints = config.etcd.endpoints.join(",");
        let etcd_error = |source| JoinError::Etcd {
            endpoints: endpoints.clone(),
            source,
        };
        let etcd = config.etcd.connect().await.map_err(etcd_error)?;
        let keys = Keys::new(&config.etcd.cluster);
        let view = view::follow(etcd.clone(), keys.clone()).await.map_err(etcd_error)?;
        let (health, _) = watch::channel(Health::Serving);
        let node = Arc::new(Self {
            keys,
            etcd,
            local,
            view,
            state: Mutex::new(Rank::NodeState, NodeState::Joining),
            // Granted as they are needed: a lease granted before a wait
            // would lapse in it.
            leases: Mutex::new(
                Rank::NodeLeases,
                Leases {
                    membership: 0,
                    grace: 0,
                },
            ),
            renewed: Mutex::new(Rank::NodeRenewed, Instant::now()),
            health,
            incarnations: AtomicU64::new(seed()),
            owned: Mutex::new(Rank::NodeOwned, HashMap::new()),
            left: AtomicBool::new(false),
            config,
        });
        node.register_first().await?;
        let sent = Instant::now();
        let grace = node
            .etcd
            .clone()
            .lease_grant(secs(node.config.grace), None)
            .await
            .map_err(etcd_error)?
            .id();
        node.leases.lock().grace = grace;
        *node.renewed.lock() = sent;
        // Renewing from here on: settling may take longer than the TTL.
        tokio::spawn(Arc::clone(&node).renew_forever());
        let joined = node.settle().await.map_err(etcd_error)?;
        node.set_state(NodeState::Serving).await.map_err(etcd_error)?;
        node.wait_to_see_itself_serving().await;
        tracing::info!(
            node = %node.config.node_id,
            cluster = %node.config.etcd.cluster,
            advertise = %node.config.advertise,
            within_grace = joined.within_grace,
            kept = joined.kept,
            forgotten = joined.forgotten,
            adopted = joined.adopted,
            "joined the cluster"
        );
        Ok((node, joined))
    }

    /// This node's id.
    pub fn id(&self) -> &str {
        &self.config.node_id
    }

    /// The cluster's name.
    pub fn cluster(&self) -> &str {
        &self.config.etcd.cluster
    }

    /// The membership as it changes.
    pub(crate) fn view_receiver(&self) -> watch::Receiver<Arc<View>> {
        self.view.clone()
    }

    /// The cluster's members as this node last saw them.
    pub fn view(&self) -> Arc<View> {
        Arc::clone(&self.view.borrow())
    }

    /// The node's standing, checked at every lease renewal (a third of the
    /// TTL); the receiver sees each change.
    pub fn health(&self) -> watch::Receiver<Health> {
        self.health.subscribe()
    }

    fn record(&self, state: NodeState) -> NodeRecord {
        NodeRecord {
            node_id: self.config.node_id.clone(),
            addr: self.config.advertise.clone(),
            peer_addr: self.config.peer_advertise.clone(),
            state,
            version: self.config.version.clone(),
            capacity: self.config.capacity,
            free: self.local.free(),
        }
    }

    /// Writes the node record under the membership lease. The first time,
    /// only if no other process's record is there; whether it was written.
    async fn register(&self, first: bool) -> Result<bool, etcd_client::Error> {
        let state = *self.state.lock();
        let lease = self.leases.lock().membership;
        let key = self.keys.node(&self.config.node_id);
        let value = serde_json::to_vec(&self.record(state)).expect("a node record serialises");
        let put = TxnOp::put(key.clone(), value, Some(PutOptions::new().with_lease(lease)));
        let txn = if first {
            Txn::new()
                .when([Compare::create_revision(key, CompareOp::Equal, 0)])
                .and_then([put])
        } else {
            Txn::new().and_then([put])
        };
        Ok(self.etcd.clone().txn(txn).await?.succeeded())
    }

    /// Registers for the first time. A record of the same id may be a
    /// killed process's, whose lease lapses within the TTL: waits that out,
    /// and refuses a live duplicate after it.
    async fn register_first(&self) -> Result<(), JoinError> {
        let deadline = Instant::now() + self.config.ttl + self.config.etcd.timeout;
        loop {
            let lease = self
                .etcd
                .clone()
                .lease_grant(secs(self.config.ttl), None)
                .await
                .map_err(|source| JoinError::Etcd {
                    endpoints: self.config.etcd.endpoints.join(","),
                    source,
                })?
                .id();
            self.leases.lock().membership = lease;
            match self.register(true).await {
                Ok(true) => return Ok(()),
                Ok(false) if Instant::now() < deadline => {
                    let key = self.keys.node(&self.config.node_id);
                    let other = self.etcd.clone().get(key, None).await.ok();
                    let other = other.as_ref().and_then(|g| g.kvs().first());
                    tracing::info!(
                        record = %other.map_or(String::new(), |kv| String::from_utf8_lossy(kv.value()).into_owned()),
                        lease = other.map_or(0, |kv| kv.lease()),
                        "a record of this node id is in etcd; waiting for its lease to lapse"
                    );
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Ok(false) => return Err(JoinError::Duplicate(self.config.node_id.clone())),
                Err(source) => {
                    return Err(JoinError::Etcd {
                        endpoints: self.config.etcd.endpoints.join(","),
                        source,
                    });
                }
            }
        }
    }

    pub(crate) async fn set_state(&self, state: NodeState) -> Result<(), etcd_client::Error> {
        *self.state.lock() = state;
        self.register(false).await.map(|_| ())
    }

    async fn wait_to_see_itself_serving(&self) {
        let mut view = self.view.clone();
        let seen = view.wait_for(|v| {
            v.member(&self.config.node_id)
                .is_some_and(|n| n.state == NodeState::Serving)
        });
        if tokio::time::timeout(self.config.etcd.timeout, seen).await.is_err() {
            tracing::warn!("the membership watch has not shown this node serving yet");
        }
    }

    /// Puts `held/<id>` under the current grace lease and works out which
    /// held sequences are still this node's: all of them if `held/<id>`
    /// was still there (back within the grace), none that had an ownership
    /// record otherwise.
    async fn settle(&self) -> Result<Joined, etcd_client::Error> {
        let mut etcd = self.etcd.clone();
        let me = self.config.node_id.as_str();
        let held = self.keys.held(me);
        let grace = self.leases.lock().grace;
        let attach = || TxnOp::put(held.clone(), "", Some(PutOptions::new().with_lease(grace)));
        let within_grace = etcd
            .txn(
                Txn::new()
                    .when([Compare::version(held.clone(), CompareOp::Greater, 0)])
                    .and_then([attach()])
                    .or_else([attach()]),
            )
            .await?
            .succeeded();
        let mut unclaimed: HashSet<SequenceKey> = self.local.sequences().into_iter().collect();
        let mut joined = Joined {
            within_grace,
            ..Joined::default()
        };
        let records = etcd
            .get(self.keys.sequences(), Some(GetOptions::new().with_prefix()))
            .await?;
        for kv in records.kvs() {
            let (Some(key), Ok(record)) = (
                self.keys.parse_sequence(kv.key()),
                serde_json::from_slice::<OwnerRecord>(kv.value()),
            ) else {
                continue;
            };
            let held_here = unclaimed.remove(&key);
            if record.node_id == me && within_grace && held_here {
                self.own(&key, record.incarnation);
                joined.kept += 1;
                continue;
            }
            if record.node_id == me {
                // Reported lost while this node was away (past the grace),
                // or held only in memory when it stopped: lost for good.
                joined.forgotten += usize::from(!held_here);
                let gone = Txn::new()
                    .when([Compare::mod_revision(kv.key(), CompareOp::Equal, kv.mod_revision())])
                    .and_then([TxnOp::delete(kv.key(), None)]);
                etcd.txn(gone).await?;
            }
            if held_here {
                self.disown(&key);
                self.local.forget(&key);
                joined.forgotten += 1;
            }
        }
        for key in unclaimed {
            let (record, incarnation) = self.owner_record(None);
            let k = self.keys.sequence(&key);
            let claimed = etcd
                .txn(
                    Txn::new()
                        .when([Compare::create_revision(k.clone(), CompareOp::Equal, 0)])
                        .and_then([TxnOp::put(k, record, None)]),
                )
                .await?
                .succeeded();
            if claimed {
                self.own(&key, incarnation);
                joined.adopted += 1;
            } else {
                self.disown(&key);
                self.local.forget(&key);
                joined.forgotten += 1;
            }
        }
        Ok(joined)
    }

    /// A new ownership record naming this node, and its incarnation.
    fn owner_record(&self, group: Option<Group>) -> (Vec<u8>, u64) {
        let record = OwnerRecord {
            node_id: self.config.node_id.clone(),
            // Never 0, which means "standalone" on the wire.
            incarnation: kvtier_core::hash::mix64(self.incarnations.fetch_add(1, Ordering::Relaxed)).max(1),
            group,
        };
        (
            serde_json::to_vec(&record).expect("an owner record serialises"),
            record.incarnation,
        )
    }

    pub(crate) fn own(&self, key: &SequenceKey, incarnation: u64) {
        self.owned.lock().insert(key.clone(), incarnation);
    }

    pub(crate) fn disown(&self, key: &SequenceKey) {
        self.owned.lock().remove(key);
    }

    /// The sequences this node owns, as of now.
    pub fn owned(&self) -> Vec<SequenceKey> {
        self.owned.lock().keys().cloned().collect()
    }

    /// The incarnation of a sequence this node owns.
    pub fn incarnation(&self, key: &SequenceKey) -> Option<u64> {
        self.owned.lock().get(key).copied()
    }

    /// Refuses a call meant for another creation of the sequence than the
    /// one this node owns.
    pub fn check_incarnation(&self, key: &SequenceKey, expected: u64) -> Result<(), Refusal> {
        match self.incarnation(key) {
            Some(owned) if owned != expected => Err(Refusal::Recreated {
                sequence: key.sequence.as_str().to_owned(),
                expected,
                now: owned,
            }),
            _ => Ok(()),
        }
    }

    /// Renews both leases every third of the membership TTL; re-registers
    /// when the membership lease expired (etcd was away longer than the
    /// TTL), settles again when the grace lease did.
    async fn renew_forever(self: Arc<Self>) {
        let period = (self.config.ttl / 3).max(Duration::from_millis(200));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut down_since: Option<Instant> = None;
        loop {
            tick.tick().await;
            if Arc::strong_count(&self) == 1 || self.left.load(Ordering::Acquire) {
                return;
            }
            let sent = Instant::now();
            match self.renew().await {
                Ok(()) => {
                    *self.renewed.lock() = sent;
                    if let Some(since) = down_since.take() {
                        tracing::info!(after_ms = since.elapsed().as_millis() as u64, "etcd is back");
                    }
                    self.health.send_if_modified(|h| {
                        let changed = *h != Health::Serving;
                        *h = Health::Serving;
                        changed
                    });
                }
                Err(e) => {
                    let since = *down_since.get_or_insert(sent);
                    let silent = self.renewed.lock().elapsed();
                    let health = if silent > self.config.grace / 2 {
                        Health::Fenced(format!("etcd unreachable for {} s: {e}", silent.as_secs()))
                    } else {
                        Health::Degraded(format!("etcd unreachable for {} ms: {e}", since.elapsed().as_millis()))
                    };
                    tracing::warn!(?health, "cannot renew the cluster leases");
                    self.health.send_replace(health);
                }
            }
        }
    }

    async fn renew(&self) -> Result<(), etcd_client::Error> {
        let (membership, grace) = {
            let l = self.leases.lock();
            (l.membership, l.grace)
        };
        if !self.keep_alive(grace).await? {
            tracing::warn!("the grace lease expired: this node's sequences are no longer its own");
            let id = self.etcd.clone().lease_grant(secs(self.config.grace), None).await?.id();
            self.leases.lock().grace = id;
            let joined = self.settle().await?;
            tracing::warn!(
                forgotten = joined.forgotten,
                adopted = joined.adopted,
                "settled after the grace"
            );
        }
        if !self.keep_alive(membership).await? {
            if self.left.load(Ordering::Acquire) {
                // Revoked by `leave`, not expired.
                return Ok(());
            }
            let id = self.etcd.clone().lease_grant(secs(self.config.ttl), None).await?.id();
            self.leases.lock().membership = id;
            self.register(false).await?;
            tracing::info!("the membership lease had expired: registered again");
        } else {
            // The record's free bytes, refreshed.
            self.register(false).await?;
        }
        Ok(())
    }

    /// One keep-alive; whether the lease still lives.
    async fn keep_alive(&self, lease: i64) -> Result<bool, etcd_client::Error> {
        let timeout = self.config.etcd.timeout;
        let once = async {
            let (mut keeper, mut stream) = self.etcd.clone().lease_keep_alive(lease).await?;
            keeper.keep_alive().await?;
            match stream.message().await? {
                Some(reply) => Ok(reply.ttl() > 0),
                None => Err(etcd_client::Error::LeaseKeepAliveError("no reply".into())),
            }
        };
        match tokio::time::timeout(timeout, once).await {
            Ok(Err(e)) if lease_gone(&e) => Ok(false),
            Ok(answer) => answer,
            Err(_) => Err(etcd_client::Error::LeaseKeepAliveError("timed out".into())),
        }
    }

    /// Whether the node may serve the sequences it holds.
    pub fn check_serving(&self) -> Result<(), Refusal> {
        let silent = self.renewed.lock().elapsed();
        if silent > self.config.grace / 2 {
            return Err(Refusal::Fenced {
                this: self.config.node_id.clone(),
                secs: silent.as_secs(),
            });
        }
        Ok(())
    }

    /// Claims a sequence about to be created here: placement must put it on
    /// this node (in this node's current view), and no other node may own
    /// the id, unless that node stayed out past its grace. `group`: the
    /// context-parallel group it is a shard of (`placement` ranks it).
    /// Returns the claimed incarnation.
    pub async fn claim(
        &self,
        key: &SequenceKey,
        placement: (PlacementKey<'_>, u32),
        group: Option<Group>,
    ) -> Result<u64, Refusal> {
        self.check_serving()?;
        let unavailable = |why: String| Refusal::Unavailable {
            this: self.config.node_id.clone(),
            what: "create a sequence",
            why,
        };
        let view = self.view();
        if !view.current {
            return Err(unavailable("its membership view is stale (etcd unreachable)".into()));
        }
        // A draining node is out of placement: the client is sent on.
        let owner = view
            .placed(placement)
            .ok_or_else(|| unavailable("no node is serving".into()))?;
        if owner.node_id != self.config.node_id {
            return Err(Refusal::Elsewhere {
                sequence: key.sequence.as_str().to_owned(),
                why: "placed on",
                owner: owner.node_id.clone(),
                addr: owner.addr.clone(),
                this: self.config.node_id.clone(),
            });
        }
        let state = *self.state.lock();
        if state != NodeState::Serving {
            return Err(unavailable(format!("it is {}", state.as_str())));
        }
        let etcd_down = |e: etcd_client::Error| unavailable(format!("etcd: {e}"));
        let mut etcd = self.etcd.clone();
        let k = self.keys.sequence(key);
        let (record, incarnation) = self.owner_record(group);
        let done = etcd
            .txn(
                Txn::new()
                    .when([Compare::create_revision(k.clone(), CompareOp::Equal, 0)])
                    .and_then([TxnOp::put(k.clone(), record.clone(), None)])
                    .or_else([TxnOp::get(k.clone(), None)]),
            )
            .await
            .map_err(etcd_down)?;
        if done.succeeded() {
            self.own(key, incarnation);
            return Ok(incarnation);
        }
        let Some(TxnOpResponse::Get(got)) = done.op_responses().into_iter().next() else {
            return Err(unavailable("etcd answered the claim without the record".into()));
        };
        let Some(kv) = got.kvs().first() else {
            return Err(unavailable("the record changed during the claim; retry".into()));
        };
        let existing: OwnerRecord = serde_json::from_slice(kv.value())
            .map_err(|e| unavailable(format!("the ownership record does not parse: {e}")))?;
        if existing.node_id == self.config.node_id {
            // Claimed here before (a create that failed or a crash between
            // the claim and the create): still this node's.
            self.own(key, existing.incarnation);
            return Ok(existing.incarnation);
        }
        // Another node's: taken over only once that node's grace is over.
        let taken = etcd
            .txn(
                Txn::new()
                    .when([
                        Compare::mod_revision(k.clone(), CompareOp::Equal, kv.mod_revision()),
                        Compare::version(self.keys.held(&existing.node_id), CompareOp::Equal, 0),
                    ])
                    .and_then([TxnOp::put(k, record, None)]),
            )
            .await
            .map_err(etcd_down)?
            .succeeded();
        if taken {
            tracing::info!(sequence = %key.sequence.as_str(), lost_with = %existing.node_id, "took over a sequence lost with its node");
            self.own(key, incarnation);
            Ok(incarnation)
        } else {
            Err(Refusal::ExistsElsewhere {
                sequence: key.sequence.as_str().to_owned(),
                owner: existing.node_id,
            })
        }
    }

    /// Gives up the ownership record of a sequence this node dropped.
    pub async fn release(&self, key: &SequenceKey) -> Result<(), etcd_client::Error> {
        self.disown(key);
        let mut etcd = self.etcd.clone();
        let k = self.keys.sequence(key);
        let got = etcd.get(k.clone(), None).await?;
        let Some(kv) = got.kvs().first() else { return Ok(()) };
        let mine = serde_json::from_slice::<OwnerRecord>(kv.value()).is_ok_and(|r| r.node_id == self.config.node_id);
        if mine {
            etcd.txn(
                Txn::new()
                    .when([Compare::mod_revision(k.clone(), CompareOp::Equal, kv.mod_revision())])
                    .and_then([TxnOp::delete(k, None)]),
            )
            .await?;
        }
        Ok(())
    }

    /// Why a sequence this node does not hold is not here: `Ok(())` when
    /// the cluster knows of no other owner (the call's NOT_FOUND stands).
    /// With `expected`, a record of another incarnation answers that the
    /// sequence was created again.
    pub async fn whereabouts(&self, key: &SequenceKey, expected: Option<u64>) -> Result<(), Refusal> {
        let mut etcd = self.etcd.clone();
        let unavailable = |e: etcd_client::Error| Refusal::Unavailable {
            this: self.config.node_id.clone(),
            what: "tell where the sequence is",
            why: format!("it is not here, and etcd, which says where it is, is unreachable: {e}"),
        };
        let got = etcd.get(self.keys.sequence(key), None).await.map_err(unavailable)?;
        let Some(record) = got
            .kvs()
            .first()
            .and_then(|kv| serde_json::from_slice::<OwnerRecord>(kv.value()).ok())
        else {
            return Ok(());
        };
        if let Some(expected) = expected.filter(|&e| e != record.incarnation) {
            return Err(Refusal::Recreated {
                sequence: key.sequence.as_str().to_owned(),
                expected,
                now: record.incarnation,
            });
        }
        if record.node_id == self.config.node_id {
            return Ok(());
        }
        let sequence = key.sequence.as_str().to_owned();
        if let Some(owner) = self.view().member(&record.node_id) {
            return Err(Refusal::Elsewhere {
                sequence,
                why: "on",
                owner: owner.node_id.clone(),
                addr: owner.addr.clone(),
                this: self.config.node_id.clone(),
            });
        }
        let held = etcd
            .get(
                self.keys.held(&record.node_id),
                Some(GetOptions::new().with_count_only()),
            )
            .await
            .map_err(unavailable)?;
        if held.count() > 0 {
            Err(Refusal::OwnerOut {
                sequence,
                owner: record.node_id,
            })
        } else {
            Err(Refusal::Lost {
                sequence,
                owner: record.node_id,
            })
        }
    }

    /// Marks the node draining (placement skips it at once), for a server
    /// that is stopping.
    pub async fn start_draining(&self) {
        if let Err(e) = self.set_state(NodeState::Draining).await {
            tracing::warn!(error = %e, "could not mark this node draining");
        }
    }

    /// Leaves the cluster: revokes the membership lease. The grace lease
    /// runs on, so a restart within the grace keeps the node's sequences.
    pub async fn leave(&self) {
        if self.left.swap(true, Ordering::AcqRel) {
            return; // left already (a drain that emptied the node)
        }
        let lease = self.leases.lock().membership;
        match self.etcd.clone().lease_revoke(lease).await {
            Ok(_) => tracing::info!(node = %self.config.node_id, "left the cluster"),
            Err(e) => tracing::warn!(error = %e, "could not revoke the membership lease; it lapses by itself"),
        }
    }
}

/// Whether etcd answered that a lease no longer exists (expired or
/// revoked): etcd-client reports it as an error when a keep-alive opens.
fn lease_gone(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::LeaseKeepAliveError(m) => m == "lease not found",
        etcd_client::Error::GRpcStatus(s) => s.code() == tonic::Code::NotFound,
        _ => false,
    }
}

/// A random start for incarnation numbers, so that two processes of one
/// node id do not repeat them.
fn seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::process::id()) ^ u64::from(std::process::id())
}
