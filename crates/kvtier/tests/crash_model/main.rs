//! Model-based crash-recovery test: seeded random sequences of operations
//! against the real `kvtier serve` (tiny host and device tiers, so pages
//! migrate to NVMe all the time; a checkpoint whenever the manifest
//! doubles), interleaved with clean restarts, kill -9 at random moments
//! and in the middle of operations, and corrupted NVMe blocks. Every read
//! is checked against an independent model (`../common/model.rs`); a
//! failing case shrinks to a short sequence of operations.
//!
//! `KVTIER_CRASH_CASES` (default 8) sets the number of cases,
//! `KVTIER_CRASH_SEED` the seed (printed on every run).

#[path = "../common/mod.rs"]
mod common;

use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::Server;
use common::model::{Fate, HEADS, Model, PAGE, SeqId, layout, prefix_hashes};
use kvtier_client::pb::apply_policy_request::Action as PolicyAction;
use kvtier_client::pb::policy::Scorer;
use kvtier_client::{Client, ClientError, actions, pb};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};
use tonic::Code;

/// Every server of a case: tiny host and device tiers (a page is 64 bytes:
/// a few dozen fit), a checkpoint whenever the manifest has doubled.
const FLAGS: [&str; 6] = [
    "--host-bytes",
    "4KiB",
    "--device-bytes",
    "2KiB",
    "--checkpoint-bytes",
    "1",
];

#[derive(Debug, Clone, Copy)]
enum Change {
    Evict,
    Summarize,
}

impl Change {
    fn fate(self, reason: pb::Reason) -> Fate {
        match self {
            Change::Evict => Fate::Gone(reason),
            Change::Summarize => Fate::Summary,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Move {
    OffloadHost,
    OffloadNvme,
    MigrateNvme,
}

/// Heads 0, 1, or both (2).
type Heads = u32;

fn heads(h: Heads) -> Range<u32> {
    if h < HEADS { h..h + 1 } else { 0..HEADS }
}

#[derive(Debug, Clone)]
enum Op {
    Create {
        seq: u8,
        prefix: Option<u8>,
    },
    Put {
        seq: u8,
        layer: u32,
        heads: Heads,
        tokens: u32,
        persist: bool,
    },
    Append {
        seq: u8,
        layer: u32,
        heads: Heads,
        tokens: u32,
        persist: bool,
    },
    Change {
        seq: u8,
        layer: u32,
        heads: Heads,
        page: u32,
        change: Change,
    },
    Move {
        seq: u8,
        layer: u32,
        page: u32,
        to: Move,
    },
    /// StreamingLLM over one layer down to `budget` tokens; `None`: offload.
    Policy {
        seq: u8,
        layer: u32,
        budget: u32,
        change: Option<Change>,
    },
    Drop {
        seq: u8,
    },
    /// Flips a byte of an NVMe block (among its first 64: page bytes).
    Corrupt {
        block: u8,
        offset: u8,
    },
    /// Reads everything back without a restart: must match exactly.
    Verify,
    Restart,
    /// kill -9 after `ms` of whatever the server does in the background.
    Kill {
        ms: u8,
    },
    /// kill -9 `us` into a write, transition or policy.
    KillDuring {
        op: Box<Op>,
        us: u16,
    },
}

fn id(seq: u8) -> SeqId {
    SeqId {
        tenant: seq % 2,
        name: seq / 2,
    }
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![Just(Change::Evict), Just(Change::Summarize)]
}

/// Operations that a kill may cut off.
fn interruptible() -> impl Strategy<Value = Op> {
    let seq = 0u8..6;
    let heads = prop_oneof![1 => 0u32..2, 4 => Just(2u32)];
    prop_oneof![
        3 => (seq.clone(), 0u32..2, heads.clone(), 1u32..=12, any::<bool>())
            .prop_map(|(seq, layer, heads, tokens, persist)| Op::Put { seq, layer, heads, tokens, persist }),
        5 => (seq.clone(), 0u32..2, heads.clone(), 1u32..=6, any::<bool>())
            .prop_map(|(seq, layer, heads, tokens, persist)| Op::Append { seq, layer, heads, tokens, persist }),
        2 => (seq.clone(), 0u32..2, heads, 0u32..8, change())
            .prop_map(|(seq, layer, heads, page, change)| Op::Change { seq, layer, heads, page, change }),
        1 => (seq, 0u32..2, 4u32..=16, proptest::option::of(change()))
            .prop_map(|(seq, layer, budget, change)| Op::Policy { seq, layer, budget, change }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let seq = 0u8..6;
    let to = prop_oneof![
        Just(Move::OffloadHost),
        Just(Move::OffloadNvme),
        Just(Move::MigrateNvme)
    ];
    prop_oneof![
        3 => (seq.clone(), proptest::option::of(0u8..2)).prop_map(|(seq, prefix)| Op::Create { seq, prefix }),
        11 => interruptible(),
        2 => (seq.clone(), 0u32..2, 0u32..8, to).prop_map(|(seq, layer, page, to)| Op::Move { seq, layer, page, to }),
        1 => seq.prop_map(|seq| Op::Drop { seq }),
        2 => (0u8..32, 0u8..64).prop_map(|(block, offset)| Op::Corrupt { block, offset }),
        1 => Just(Op::Verify),
        1 => Just(Op::Restart),
        1 => (0u8..40).prop_map(|ms| Op::Kill { ms }),
        2 => (interruptible(), 0u16..3000).prop_map(|(op, us)| Op::KillDuring { op: Box::new(op), us }),
    ]
}

/// A request, planned from the model, and what the model expects of it.
#[derive(Debug, Clone)]
enum Planned {
    Create {
        id: SeqId,
        prefix: Option<u8>,
        exists: bool,
    },
    Write {
        id: SeqId,
        layer: u32,
        heads: Range<u32>,
        at: u64,
        n: u64,
        persist: bool,
        put: bool,
        kv: bytes::Bytes,
        ok: bool,
    },
    Change {
        id: SeqId,
        layer: u32,
        heads: Range<u32>,
        page: u32,
        change: Change,
        ok: bool,
    },
    Move {
        id: SeqId,
        layer: u32,
        page: u32,
        to: Move,
    },
    Policy {
        id: SeqId,
        layer: u32,
        budget: u32,
        change: Option<Change>,
    },
    Drop {
        id: SeqId,
        exists: bool,
    },
}

/// What a request answered (attached pages for a create, durability for a
/// write).
type Answer = Result<(u64, pb::Durability), ClientError>;

fn code(answer: &Answer) -> Option<Code> {
    match answer {
        Ok(_) => None,
        Err(ClientError::Status(s)) => Some(s.code()),
        Err(_) => Some(Code::Unavailable),
    }
}

fn plan(model: &Model, op: &Op) -> Option<Planned> {
    let modelled = |seq: u8| model.seqs.get(&id(seq));
    Some(match op.clone() {
        Op::Create { seq, prefix } => Planned::Create {
            id: id(seq),
            prefix,
            exists: modelled(seq).is_some(),
        },
        Op::Put {
            seq,
            layer,
            heads: h,
            tokens,
            persist,
        }
        | Op::Append {
            seq,
            layer,
            heads: h,
            tokens,
            persist,
        } => {
            let put = matches!(op, Op::Put { .. });
            let rows = modelled(seq)?.rows(layer, heads(h));
            let at = rows[0];
            let same = rows.iter().all(|r| *r == at);
            let ok = same
                && if put {
                    at % PAGE == 0
                } else {
                    !model.append_refused(id(seq), layer, heads(h))
                };
            let n = u64::from(tokens);
            Planned::Write {
                id: id(seq),
                layer,
                heads: heads(h),
                at,
                n,
                persist,
                put,
                kv: model.kv(id(seq), layer, heads(h), at, at + n),
                ok,
            }
        }
        Op::Change {
            seq,
            layer,
            heads: h,
            page,
            change,
        } => {
            let full = modelled(seq)?.rows(layer, heads(h)).into_iter().min()? / PAGE;
            let page = page % u32::try_from(full).ok().filter(|f| *f > 0)?;
            let fate = change.fate(pb::Reason::Explicit);
            Planned::Change {
                id: id(seq),
                layer,
                heads: heads(h),
                page,
                change,
                ok: model.change_allowed(id(seq), layer, heads(h), u64::from(page), fate),
            }
        }
        Op::Move { seq, layer, page, to } => {
            let full = modelled(seq)?.rows(layer, 0..HEADS).into_iter().min()? / PAGE;
            let page = page % u32::try_from(full).ok().filter(|f| *f > 0)?;
            Planned::Move {
                id: id(seq),
                layer,
                page,
                to,
            }
        }
        Op::Policy {
            seq,
            layer,
            budget,
            change,
        } => {
            modelled(seq)?;
            Planned::Policy {
                id: id(seq),
                layer,
                budget,
                change,
            }
        }
        Op::Drop { seq } => Planned::Drop {
            id: id(seq),
            exists: modelled(seq).is_some(),
        },
        Op::Corrupt { .. } | Op::Verify | Op::Restart | Op::Kill { .. } | Op::KillDuring { .. } => return None,
    })
}

/// Sends a planned request.
async fn send(planned: Planned, client: Client) -> Answer {
    let done = (0, pb::Durability::Unspecified);
    match planned {
        Planned::Create { id, prefix, .. } => {
            let hashes = prefix.map(prefix_hashes).unwrap_or_default();
            let mut c = client.with_tenant(id.tenant());
            let r = c.create_sequence(&id.name(), layout(), hashes).await?;
            Ok((r.attached_pages, pb::Durability::Unspecified))
        }
        Planned::Write {
            id,
            layer,
            heads,
            at,
            n,
            persist,
            put,
            kv,
            ..
        } => {
            let mut c = client.with_tenant(id.tenant()).with_persist(persist);
            let durability = if put {
                let first_page = (at / PAGE) as u32;
                c.put_pages(&id.name(), layer, heads, first_page, n as u32, kv)
                    .await?
                    .durability()
            } else {
                c.append_tokens(&id.name(), layer, heads, n as u32, kv, Some(at))
                    .await?
                    .durability()
            };
            Ok((0, durability))
        }
        Planned::Change {
            id,
            layer,
            heads,
            page,
            change,
            ..
        } => {
            let action = match change {
                Change::Evict => actions::evict(),
                Change::Summarize => actions::summarize(1),
            };
            let mut c = client.with_tenant(id.tenant());
            c.set_page_state(&id.name(), layer..layer + 1, heads, page..page + 1, action)
                .await?;
            Ok(done)
        }
        Planned::Move { id, layer, page, to } => {
            let action = match to {
                Move::OffloadHost => actions::offload_to_host(),
                Move::OffloadNvme => actions::offload_to_nvme(),
                Move::MigrateNvme => actions::migrate_to_nvme(),
            };
            let mut c = client.with_tenant(id.tenant());
            c.set_page_state(&id.name(), layer..layer + 1, 0..HEADS, page..page + 1, action)
                .await?;
            Ok(done)
        }
        Planned::Policy {
            id,
            layer,
            budget,
            change,
        } => {
            let action = match change {
                Some(Change::Evict) => PolicyAction::Evict(pb::Evict {}),
                Some(Change::Summarize) => PolicyAction::Summarize(pb::Summarize { rows: 1 }),
                None => PolicyAction::Offload(pb::Offload {
                    tier: pb::Tier::Host as i32,
                }),
            };
            let req = pb::ApplyPolicyRequest {
                layer_start: layer,
                layer_count: 1,
                policy: Some(pb::Policy {
                    scorer: Some(Scorer::Streaming(pb::StreamingPolicy { sink_tokens: 4 })),
                    allocator: None,
                }),
                budget_tokens: budget,
                action: Some(action),
                ..Default::default()
            };
            client.with_tenant(id.tenant()).apply_policy(&id.name(), req).await?;
            Ok(done)
        }
        Planned::Drop { id, .. } => {
            client.with_tenant(id.tenant()).drop_sequence(&id.name()).await?;
            Ok(done)
        }
    }
}

/// Applies an answer to the model. `acked`: the answer arrived (a request
/// a kill cut off may or may not have taken effect).
fn apply(model: &mut Model, planned: &Planned, answer: &Answer, acked: bool) -> Result<(), String> {
    let got = code(answer);
    let expect = |wanted: Option<Code>| {
        if !acked || got == wanted {
            Ok(())
        } else {
            Err(format!("{planned:?}: expected {wanted:?}, got {answer:?}"))
        }
    };
    match planned {
        Planned::Create { id, prefix, exists } => {
            if *exists {
                return expect(Some(Code::AlreadyExists));
            }
            expect(None)?;
            if let Ok((attached, _)) = answer {
                let most = if prefix.is_some() {
                    common::model::PREFIX_PAGES
                } else {
                    0
                };
                if *attached > most {
                    return Err(format!("{planned:?}: {attached} pages attached"));
                }
                model.created(*id, *prefix, *attached);
            }
        }
        Planned::Write {
            id,
            layer,
            heads,
            n,
            persist,
            ok,
            ..
        } => {
            if !ok {
                return expect(Some(Code::FailedPrecondition));
            }
            expect(None)?;
            if let Ok((_, durability)) = answer {
                let wanted = if *persist {
                    pb::Durability::Relaxed
                } else {
                    pb::Durability::Memory
                };
                if *durability != wanted {
                    return Err(format!("{planned:?}: acknowledged {durability:?}"));
                }
            }
            model.wrote(*id, *layer, heads.clone(), *n, *persist, answer.is_ok());
        }
        Planned::Change {
            id,
            layer,
            heads,
            page,
            change,
            ok,
        } => {
            if !ok {
                return expect(Some(Code::FailedPrecondition));
            }
            expect(None)?;
            let fate = change.fate(pb::Reason::Explicit);
            model.changed(*id, *layer, heads.clone(), u64::from(*page), fate, answer.is_ok());
        }
        Planned::Move { .. } => {
            // Whether a move is legal depends on the tier the page is in,
            // which the model does not track; either way no byte changes.
            if !matches!(got, None | Some(Code::FailedPrecondition)) {
                return Err(format!("{planned:?}: {answer:?}"));
            }
            model.acked(true);
        }
        Planned::Policy { id, layer, change, .. } => {
            expect(None)?;
            let fate = change.map(|c| c.fate(pb::Reason::Policy));
            if answer.is_ok() && acked {
                model.acked(true);
            } else {
                model.policy_unsure(*id, *layer, fate);
            }
        }
        Planned::Drop { id, exists } => {
            if !exists {
                return expect(Some(Code::NotFound));
            }
            expect(None)?;
            model.dropped(*id);
        }
    }
    Ok(())
}

/// One case: a data directory, a server, a model.
struct Case {
    dir: tempfile::TempDir,
    server: Option<Server>,
    client: Client,
    model: Model,
    stats: Stats,
}

#[derive(Debug, Default, Clone, Copy)]
struct Stats {
    cases: u64,
    ops: u64,
    clean_restarts: u64,
    kills: u64,
    kills_mid_op: u64,
    checkpoints: u64,
}

impl Case {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut server = Server::start(dir.path(), &FLAGS);
        let client = server.client().await;
        Self {
            dir,
            server: Some(server),
            client,
            model: Model::default(),
            stats: Stats::default(),
        }
    }

    /// Stops (kills, or terminates) the server, starts it again, and
    /// checks everything against the model.
    async fn restart(&mut self, kill: bool) {
        if let Some(server) = self.server.take() {
            if kill {
                server.kill();
            } else {
                server.terminate();
            }
        }
        let mut server = Server::start(self.dir.path(), &FLAGS);
        self.client = server.client().await;
        self.server = Some(server);
        self.model.check(&self.client, true, None).await;
    }

    async fn run(&mut self, op: &Op) {
        self.stats.ops += 1;
        match op {
            Op::Verify => self.model.check(&self.client, false, None).await,
            Op::Restart => {
                self.stats.clean_restarts += 1;
                self.restart(false).await;
            }
            Op::Kill { ms } => {
                tokio::time::sleep(Duration::from_millis(u64::from(*ms))).await;
                self.stats.kills += 1;
                self.restart(true).await;
            }
            Op::Corrupt { block, offset } => {
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(self.dir.path().join("nvme.data"))
                    .unwrap();
                let at = u64::from(*block) * 4096 + u64::from(*offset);
                let mut byte = [0u8];
                file.read_exact_at(&mut byte, at).unwrap();
                file.write_all_at(&[byte[0] ^ 0x5a], at).unwrap();
                file.sync_all().unwrap();
                self.model.corruptions += 1;
                // Reading finds the page the block held (if only its NVMe
                // copy is left); later restarts must keep it gone for that.
                self.model.check(&self.client, false, None).await;
            }
            Op::KillDuring { op, us } => {
                self.stats.kills_mid_op += 1;
                let planned = plan(&self.model, op);
                let task = planned.clone().map(|p| tokio::spawn(send(p, self.client.clone())));
                tokio::time::sleep(Duration::from_micros(u64::from(*us))).await;
                if let Some(server) = self.server.take() {
                    server.kill();
                }
                if let (Some(planned), Some(task)) = (planned, task) {
                    let answer = task.await.unwrap();
                    if let Err(e) = apply(&mut self.model, &planned, &answer, answer.is_ok()) {
                        self.model.findings.other += 1;
                        self.model.findings.messages.push(e);
                    }
                }
                self.restart(true).await;
            }
            op => {
                let Some(planned) = plan(&self.model, op) else { return };
                let answer = send(planned.clone(), self.client.clone()).await;
                if let Err(e) = apply(&mut self.model, &planned, &answer, true) {
                    self.model.findings.other += 1;
                    self.model.findings.messages.push(e);
                }
                if let (Planned::Policy { id, change, .. }, Ok(_)) = (&planned, &answer) {
                    // Which pages a policy picks is its business: adopt the
                    // changes it made, as long as they are its action's.
                    let adopt = change.map(|c| (*id, c.fate(pb::Reason::Policy)));
                    self.model.check(&self.client, false, adopt).await;
                }
            }
        }
    }

    /// Counts what the servers' logs say happened in the background.
    fn count_logs(&mut self) {
        for entry in std::fs::read_dir(self.dir.path()).unwrap().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("serve-") {
                let log = std::fs::read_to_string(entry.path()).unwrap_or_default();
                self.stats.checkpoints += log.matches("manifest checkpoint written").count() as u64;
            }
        }
    }
}

async fn run_case(ops: Vec<Op>) -> Result<Stats, String> {
    let mut case = Case::start().await;
    for op in &ops {
        case.run(op).await;
        if case.model.findings.violations() > 0 {
            break;
        }
    }
    if case.model.findings.violations() == 0 {
        case.stats.clean_restarts += 1;
        case.restart(false).await;
    }
    case.count_logs();
    case.stats.cases = 1;
    let findings = &case.model.findings;
    if findings.violations() > 0 {
        return Err(format!(
            "{} violations ({} durable rows lost, {} wrong pages, {} fates changed, {} other):\n{}",
            findings.violations(),
            findings.durable_rows_lost,
            findings.wrong_bytes,
            findings.fate_changed,
            findings.other,
            findings.messages.join("\n")
        ));
    }
    Ok(case.stats)
}

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[test]
fn random_operations_crashes_and_restarts_lose_nothing_acknowledged() {
    let cases = env("KVTIER_CRASH_CASES").unwrap_or(8) as u32;
    let seed = env("KVTIER_CRASH_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    });
    println!("KVTIER_CRASH_SEED={seed} KVTIER_CRASH_CASES={cases}");
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_time: 10 * 60 * 1000,
        ..Config::default()
    };
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut runner = TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes));
    let total = std::sync::Mutex::new(Stats::default());
    let started = Instant::now();
    let result = runner.run(&proptest::collection::vec(op(), 10..40), |ops| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let stats = runtime.block_on(run_case(ops)).map_err(TestCaseError::fail)?;
        let mut t = total.lock().unwrap();
        t.cases += stats.cases;
        t.ops += stats.ops;
        t.clean_restarts += stats.clean_restarts;
        t.kills += stats.kills;
        t.kills_mid_op += stats.kills_mid_op;
        t.checkpoints += stats.checkpoints;
        Ok(())
    });
    let t = total.into_inner().unwrap();
    println!(
        "{} cases, {} operations, {} clean restarts, {} kills (idle), {} kills mid-operation, \
         {} checkpoints written, in {:.1} s",
        t.cases,
        t.ops,
        t.clean_restarts,
        t.kills,
        t.kills_mid_op,
        t.checkpoints,
        started.elapsed().as_secs_f64()
    );
    match result {
        Ok(()) => {}
        Err(TestError::Fail(why, ops)) => {
            panic!(
                "KVTIER_CRASH_SEED={seed}: {why}\nminimal case ({} operations):\n{ops:#?}",
                ops.len()
            )
        }
        Err(e) => panic!("KVTIER_CRASH_SEED={seed}: {e}"),
    }
}
