//! A model-based test of the cluster: random creates, page writes, reads and
//! drops through the routing client while nodes are killed (-9), stopped
//! (SIGTERM), restarted over their data, cut off from etcd (each node
//! reaches etcd through its own proxy), drained (their sequences streamed
//! to other nodes, then they leave) or rebalanced, and etcd is killed and
//! restarted. Every read is checked against an independent model:
//! - bytes, when served, are exactly the sequence's acknowledged pages (of
//!   its current incarnation: a re-created id has new values);
//! - refusals are precise: UNAVAILABLE only while a fault is recent,
//!   DATA_LOSS / NOT_FOUND only for a sequence whose owner stayed away
//!   long enough to lose it;
//! - no two live nodes hold one sequence at once;
//! - a drain or rebalance in a quiet cluster moves every sequence it
//!   should, and a drained node leaves and stops.
//!
//! `KVTIER_CLUSTER_OPS` sets the number of operations (`bench/cluster-soak.sh`
//! runs thousands), `KVTIER_CLUSTER_SEED` the seed.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::Server;
use common::cluster::{cluster, code, node, read};
use common::etcd::{Etcd, Proxy};
use kvtier_client::{Client, Cluster, layout, pb};
use proptest::prelude::RngExt;
use tonic::Code;

const DIM: usize = 4;
const PAGE: usize = 4;
const NODES: usize = 3;
const TTL: u32 = 1;
const GRACE: u32 = 5;

/// f32, 1 layer, 1 KV head, head_dim 4, page size 4: every value exact.
fn tiny() -> pb::Layout {
    layout(1, 1, 1, DIM as u32, pb::DType::DtypeF32, PAGE as u32)
}

/// One page's bytes (K rows, then V rows): values unique to (sequence
/// number, incarnation, page, token), so a byte from anywhere else shows.
fn page(seq: u32, incarnation: u32, p: u32) -> Vec<u8> {
    let base = ((seq * 64 + incarnation) * 64 + p) * 8;
    let row = |t: u32, plus: f32| (0..DIM).flat_map(move |_| ((base + t) as f32 + plus).to_le_bytes());
    (0..PAGE as u32)
        .flat_map(|t| row(t, 0.0))
        .chain((0..PAGE as u32).flat_map(|t| row(t, 0.5)))
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Its owner has not been away long enough to lose it.
    Live,
    /// Its owner was away at least about its grace: it may be lost.
    MaybeLost,
    /// A read said it is lost: it may never be served again.
    Lost,
}

#[derive(Debug)]
struct Seq {
    number: u32,
    incarnation: u32,
    owner: String,
    /// Acknowledged pages.
    pages: u32,
    /// A write whose outcome is unknown (its call failed).
    pending: bool,
    fate: Fate,
}

impl Seq {
    fn name(&self) -> String {
        format!("s{}", self.number)
    }

    fn bytes(&self, pages: u32) -> Vec<u8> {
        (0..pages)
            .flat_map(|p| page(self.number, self.incarnation, p))
            .collect()
    }
}

struct Slot {
    id: String,
    server: Option<Server>,
    /// When it went down, while it is down.
    down_since: Option<Instant>,
    /// A connection straight to it, while it is up.
    direct: Option<Client>,
    /// Its way to etcd, which a partition cuts.
    proxy: Proxy,
    /// When it was cut off from etcd, while it is.
    cut_since: Option<Instant>,
    /// A drain of it ended without emptying it: it stays draining (and
    /// out of placement) until drained again, rebalanced or restarted.
    draining: bool,
}

struct World {
    dir: tempfile::TempDir,
    etcd: Etcd,
    etcd_up: bool,
    slots: Vec<Slot>,
    cluster: Cluster,
    seqs: BTreeMap<u32, Seq>,
    /// The last kill, stop, restart or etcd change.
    last_fault: Instant,
    log: Vec<String>,
}

/// How long after the last fault reads must all succeed again: a lapsed
/// lease, a restarted node's join, the client's view catching up.
const SETTLE: Duration = Duration::from_secs(TTL as u64 * 3 + 3);

impl World {
    fn quiet(&self) -> bool {
        self.etcd_up
            && self
                .slots
                .iter()
                .all(|s| s.server.is_some() && s.cut_since.is_none() && !s.draining)
            && self.last_fault.elapsed() > SETTLE
    }

    /// Away (down or cut off) about its grace or longer: its sequences
    /// may be lost (etcd extends leases across its own outages, so this
    /// is a lower bound).
    fn away(&mut self, id: &str, away: Option<Duration>) {
        if away.is_some_and(|a| a + Duration::from_millis(1500) >= Duration::from_secs(GRACE as u64)) {
            for seq in self.seqs.values_mut().filter(|s| s.owner == id && s.fate == Fate::Live) {
                seq.fate = Fate::MaybeLost;
            }
        }
    }

    /// Nodes down or cut off for about their grace: their sequences may be
    /// lost (or taken over) already, while they are still away.
    fn age(&mut self) {
        let away: Vec<(String, Duration)> = self
            .slots
            .iter()
            .filter_map(|s| s.down_since.or(s.cut_since).map(|t| (s.id.clone(), t.elapsed())))
            .collect();
        for (id, for_) in away {
            self.away(&id, Some(for_));
        }
    }

    fn cut(&mut self, i: usize) {
        self.slots[i].proxy.cut();
        self.slots[i].cut_since = Some(Instant::now());
        let id = self.slots[i].id.clone();
        self.fault(format!("cut {id}"));
    }

    fn heal(&mut self, i: usize) {
        self.slots[i].proxy.heal();
        let away = self.slots[i].cut_since.take().map(|t| t.elapsed());
        let id = self.slots[i].id.clone();
        self.away(&id, away);
        self.fault(format!("heal {id} (cut {away:?})"));
    }

    fn up(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| self.slots[i].server.is_some())
            .collect()
    }

    fn fault(&mut self, what: String) {
        self.last_fault = Instant::now();
        self.log.push(what);
    }

    async fn start(&mut self, i: usize) {
        let id = self.slots[i].id.clone();
        if self.slots[i].cut_since.is_some() {
            self.heal(i);
        }
        let mut server = node(self.dir.path(), &id, &self.slots[i].proxy.url, TTL, GRACE);
        let away = self.slots[i].down_since.take().map(|t| t.elapsed());
        self.away(&id, away);
        self.slots[i].direct = Some(server.client().await);
        self.slots[i].server = Some(server);
        self.slots[i].draining = false;
        self.fault(format!("start {id} (away {away:?})"));
    }

    fn down(&mut self, i: usize, kill: bool) {
        let id = self.slots[i].id.clone();
        if kill {
            // A create is durable with its first persisted write: one with
            // none acknowledged may be gone after a crash.
            for seq in self
                .seqs
                .values_mut()
                .filter(|s| s.owner == id && s.pages == 0 && s.fate == Fate::Live)
            {
                seq.fate = Fate::MaybeLost;
            }
        }
        if let Some(server) = self.slots[i].server.take() {
            server.stop(kill);
        }
        self.slots[i].direct = None;
        self.slots[i].down_since = Some(Instant::now());
        self.fault(format!("{} {id}", if kill { "kill" } else { "stop" }));
    }

    async fn create(&mut self, number: u32) {
        let incarnation = self.seqs.get(&number).map_or(0, |s| s.incarnation + 1);
        let name = format!("s{number}");
        match self.cluster.create_sequence(&name, tiny(), vec![]).await {
            Ok((placed, _)) => {
                self.log.push(format!("create {name} on {}", placed.node_id));
                if let Some(old) = self.seqs.get(&number) {
                    assert_ne!(
                        old.fate,
                        Fate::Live,
                        "{name} was created twice while live:\n{}",
                        self.trail()
                    );
                }
                self.seqs.insert(
                    number,
                    Seq {
                        number,
                        incarnation,
                        owner: placed.node_id,
                        pages: 0,
                        pending: false,
                        fate: Fate::Live,
                    },
                );
            }
            Err(e) => {
                let c = code(&e);
                let fine = match c {
                    Code::AlreadyExists => self.seqs.get(&number).is_some_and(|s| s.fate != Fate::Lost),
                    Code::Unavailable | Code::FailedPrecondition => !self.quiet(),
                    _ => false,
                };
                assert!(fine, "create {name}: {e}\n{}", self.trail());
                self.log.push(format!("create {name}: {c:?}"));
            }
        }
    }

    async fn write(&mut self, number: u32) {
        let quiet = self.quiet();
        let seq = self.seqs.get_mut(&number).unwrap();
        if seq.pending || seq.fate != Fate::Live {
            return;
        }
        let (name, p) = (seq.name(), seq.pages);
        let bytes = page(seq.number, seq.incarnation, p);
        let result = self
            .cluster
            .call(&name, |c| {
                let (name, bytes) = (name.clone(), bytes.clone());
                async move {
                    c.with_persist(true)
                        .put_pages(&name, 0, 0..1, p, PAGE as u32, bytes.into())
                        .await
                }
            })
            .await;
        match result {
            Ok(_) => seq.pages += 1,
            Err(e) => {
                assert!(
                    !quiet && code(&e) == Code::Unavailable,
                    "write {name} page {p}: {e}\n{}",
                    self.trail()
                );
                // Applied or not: the next read tells.
                self.seqs.get_mut(&number).unwrap().pending = true;
            }
        }
        self.log.push(format!("write {name} page {p}"));
    }

    async fn read(&mut self, number: u32) {
        let quiet = self.quiet();
        let seq = self.seqs.get(&number).unwrap();
        let name = seq.name();
        let result = self.cluster.call(&name, |c| read(c, &name)).await;
        let seq = self.seqs.get_mut(&number).unwrap();
        match result {
            Ok(bytes) => {
                assert_ne!(
                    seq.fate,
                    Fate::Lost,
                    "{name}: served after it was reported lost\n{}",
                    trail(&self.log)
                );
                if bytes == seq.bytes(seq.pages) {
                    seq.pending = false;
                } else if seq.pending && bytes == seq.bytes(seq.pages + 1) {
                    seq.pages += 1;
                    seq.pending = false;
                } else {
                    panic!(
                        "{name} (incarnation {}, {} pages, pending {}): wrong bytes\n{}",
                        seq.incarnation,
                        seq.pages,
                        seq.pending,
                        trail(&self.log)
                    );
                }
                if seq.fate == Fate::MaybeLost && quiet {
                    // Its owner came back in time: it stays.
                    seq.fate = Fate::Live;
                }
                self.log.push(format!("read {name}: {} pages", seq.pages));
            }
            Err(e) => {
                let c = code(&e);
                let fine = match c {
                    Code::Unavailable => !quiet,
                    Code::DataLoss | Code::NotFound => seq.fate != Fate::Live,
                    _ => false,
                };
                assert!(
                    fine,
                    "read {name} ({:?}, quiet {quiet}): {e}\n{}",
                    seq.fate,
                    trail(&self.log)
                );
                if matches!(c, Code::DataLoss | Code::NotFound) {
                    seq.fate = Fate::Lost;
                }
                self.log.push(format!("read {name}: {c:?}"));
            }
        }
    }

    /// Drains node `i` (or with `stay`, rebalances it) through its own
    /// admin call: each sequence it reports moved has its new owner; in a
    /// quiet cluster every sequence moves, and a drained node leaves and
    /// stops.
    async fn drain(&mut self, i: usize, stay: bool) {
        let quiet = self.quiet();
        let id = self.slots[i].id.clone();
        let Some(client) = self.slots[i].direct.as_mut() else {
            return;
        };
        let what = if stay { "rebalance" } else { "drain" };
        let mut progress = match client.drain_node(&id, 2, stay).await {
            Ok(p) => p,
            Err(e) => {
                assert!(!quiet, "{what} {id}: {e}\n{}", self.trail());
                self.log.push(format!("{what} {id}: {:?}", code(&e)));
                return;
            }
        };
        let (mut moved, mut done) = (Vec::new(), None);
        loop {
            match progress.message().await {
                Ok(Some(pb::DrainProgress {
                    event: Some(pb::drain_progress::Event::Sequence(s)),
                })) => moved.push(s),
                Ok(Some(pb::DrainProgress {
                    event: Some(pb::drain_progress::Event::Done(d)),
                })) => {
                    done = Some(d);
                    break;
                }
                Ok(_) => break,
                Err(e) => {
                    assert!(!quiet, "{what} {id}: {e}\n{}", self.trail());
                    break;
                }
            }
        }
        for m in &moved {
            // A create whose answer was lost may have made one the model
            // does not know of.
            let number: u32 = m.sequence_id[1..].parse().unwrap();
            let Some(seq) = self.seqs.get_mut(&number) else {
                continue;
            };
            if m.error.is_empty() {
                seq.owner = m.to_node.clone();
            } else {
                assert!(
                    !quiet,
                    "{what} {id}: {} did not move: {}\n{}",
                    m.sequence_id,
                    m.error,
                    self.trail()
                );
            }
        }
        let left = done.as_ref().is_some_and(|d| d.left);
        self.slots[i].draining = !stay && !left;
        let failed = done.as_ref().map_or(0, |d| d.failed);
        assert!(
            !quiet || done.is_some(),
            "{what} {id} ended without its totals\n{}",
            self.trail()
        );
        if quiet && !stay {
            assert!(left, "{what} {id} in a quiet cluster did not leave\n{}", self.trail());
        }
        self.fault(format!(
            "{what} {id}: {} moved, {failed} not, left {left}",
            moved.len() - failed as usize
        ));
        if left {
            let mut server = self.slots[i].server.take().unwrap();
            let status = server.wait(Duration::from_secs(30));
            assert!(status.success(), "{id} exited {status} after its drain");
            self.slots[i].direct = None;
            self.slots[i].down_since = Some(Instant::now());
            for seq in self.seqs.values() {
                assert!(
                    seq.owner != id || seq.fate != Fate::Live,
                    "{} still {id}'s after it left",
                    seq.name()
                );
            }
        }
    }

    /// No two live nodes hold one sequence.
    async fn one_owner_each(&mut self) {
        for seq in self.seqs.values() {
            let name = seq.name();
            let mut holders = Vec::new();
            for slot in &mut self.slots {
                let Some(client) = slot.direct.as_mut() else { continue };
                if client.get_sequence(&name).await.is_ok() {
                    holders.push(slot.id.clone());
                }
            }
            assert!(holders.len() <= 1, "{name} held by {holders:?}\n{}", trail(&self.log));
        }
    }

    fn trail(&self) -> String {
        trail(&self.log)
    }
}

fn trail(log: &[String]) -> String {
    let from = log.len().saturating_sub(40);
    format!("last operations:\n  {}", log[from..].join("\n  "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_operations_and_faults_never_serve_a_wrong_byte() {
    let ops: usize = std::env::var("KVTIER_CLUSTER_OPS").map_or(120, |v| v.parse().unwrap());
    let seed: u64 = std::env::var("KVTIER_CLUSTER_SEED").map_or(0x6b76_7469_6572, |v| v.parse().unwrap());
    eprintln!("KVTIER_CLUSTER_SEED={seed} KVTIER_CLUSTER_OPS={ops}");
    let mut rng = common::seeded(proptest::test_runner::Config::default(), seed, 0).new_rng();
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path());
    let mut slots = Vec::new();
    for i in 0..NODES {
        let id = format!("n{i}");
        let proxy = Proxy::start(&etcd.client_url).await;
        let mut server = node(dir.path(), &id, &proxy.url, TTL, GRACE);
        let direct = Some(server.client().await);
        slots.push(Slot {
            id,
            server: Some(server),
            down_since: None,
            direct,
            proxy,
            cut_since: None,
            draining: false,
        });
    }
    let cluster = cluster(&etcd.client_url, NODES).await;
    let mut world = World {
        dir,
        etcd,
        etcd_up: true,
        slots,
        cluster,
        seqs: BTreeMap::new(),
        last_fault: Instant::now() - SETTLE,
        log: Vec::new(),
    };
    let names = 16u32;
    for step in 0..ops {
        world.age();
        let roll = rng.random_range(0..100u32);
        // Writes, reads and drops go to a sequence the model has.
        let known: Vec<u32> = world.seqs.keys().copied().collect();
        let (number, exists) = match roll {
            12..78 | 95..98 if !known.is_empty() => (known[rng.random_range(0..known.len())], true),
            _ => (rng.random_range(0..names), false),
        };
        match roll {
            0..12 => world.create(number).await,
            12..45 if exists => world.write(number).await,
            45..75 if exists => world.read(number).await,
            77..79 => {
                let up = world.up();
                if up.len() > 1 {
                    let i = up[rng.random_range(0..up.len())];
                    let kill = rng.random_bool(0.7);
                    world.down(i, kill);
                }
            }
            79..84 => {
                let down: Vec<usize> = (0..NODES).filter(|&i| world.slots[i].server.is_none()).collect();
                // A node starts only with etcd up (it joins before serving).
                if let Some(&i) = down.first().filter(|_| world.etcd_up) {
                    world.start(i).await;
                }
            }
            75..77 => {
                // One node at a time cut off from etcd; healed as often.
                match (0..NODES).find(|&i| world.slots[i].cut_since.is_some()) {
                    Some(i) => world.heal(i),
                    None => {
                        let up = world.up();
                        let i = up[rng.random_range(0..up.len())];
                        world.cut(i);
                    }
                }
            }
            84..86 => {
                if world.etcd_up {
                    world.etcd.kill();
                    world.etcd_up = false;
                    world.fault("kill etcd".into());
                } else {
                    world.etcd.restart();
                    world.etcd_up = true;
                    world.fault("restart etcd".into());
                }
            }
            86..95 => {
                let ms = rng.random_range(200..3000u64);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                world.log.push(format!("sleep {ms} ms"));
            }
            98..100 => {
                let up = world.up();
                if up.len() > 1 {
                    let i = up[rng.random_range(0..up.len())];
                    let stay = rng.random_bool(0.3);
                    world.drain(i, stay).await;
                }
            }
            95..98 if exists && world.quiet() => {
                let name = format!("s{number}");
                if world.seqs[&number].fate == Fate::Live {
                    world.cluster.drop_sequence(&name).await.unwrap();
                    world.seqs.remove(&number);
                    world.log.push(format!("drop {name}"));
                }
            }
            _ => {}
        }
        if step % 10 == 9 {
            world.one_owner_each().await;
        }
    }

    // Everything back: every sequence not lost is served exactly.
    for i in 0..NODES {
        if world.slots[i].cut_since.is_some() {
            world.heal(i);
        }
    }
    if !world.etcd_up {
        world.etcd.restart();
        world.etcd_up = true;
        world.fault("restart etcd".into());
    }
    for i in 0..NODES {
        if world.slots[i].server.is_none() {
            world.start(i).await;
        } else if world.slots[i].direct.is_none() {
            let server = world.slots[i].server.as_mut().unwrap();
            world.slots[i].direct = Some(server.client().await);
        }
    }
    // A node whose drain did not empty it serves again.
    for i in 0..NODES {
        if world.slots[i].draining {
            tokio::time::sleep(SETTLE).await;
            world.drain(i, true).await;
        }
    }
    world
        .cluster
        .wait_for_serving(NODES, Duration::from_secs(60))
        .await
        .unwrap();
    tokio::time::sleep(SETTLE).await;
    let numbers: Vec<u32> = world.seqs.keys().copied().collect();
    for number in numbers {
        world.read(number).await;
    }
    world.one_owner_each().await;
    let count = |p: &str| world.log.iter().filter(|l| l.starts_with(p)).count();
    let refused = world
        .log
        .iter()
        .filter(|l| l.starts_with("read") && !l.ends_with("pages"))
        .count();
    eprintln!(
        "{ops} operations: {} creates, {} writes, {} reads ({refused} refused), {} drops; {} kills, {} stops, \
         {} starts, {} cuts, {} etcd kills, {} drains, {} rebalances; {} sequences at the end, {} lost",
        count("create"),
        count("write"),
        count("read"),
        count("drop"),
        count("kill n"),
        count("stop"),
        count("start"),
        count("cut"),
        count("kill etcd"),
        count("drain"),
        count("rebalance"),
        world.seqs.len(),
        world.seqs.values().filter(|s| s.fate == Fate::Lost).count(),
    );
}
