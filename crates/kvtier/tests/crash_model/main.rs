//! Model-based crash-recovery test: seeded random sequences of operations
//! against the real `kvtier serve` (tiny host and device tiers, so pages
//! migrate to NVMe all the time; a checkpoint whenever the manifest
//! doubles), interleaved with clean restarts, kill -9 at random moments
//! and in the middle of operations, and corrupted NVMe blocks. Every read
//! is checked against an independent model (`../common/model.rs`); a
//! failing case shrinks to a short sequence of operations.
//!
//! `KVTIER_CRASH_CASES` (default 32) sets the number of cases,
//! `KVTIER_CRASH_SEED` the seed (printed on every run).

#[path = "../common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::model::Model;
use common::ops::{Op, Planned, apply, op, plan, send};
use common::{FLAGS, Server, corrupt_nvme, env, seeded};
use kvtier_client::{Client, pb};
use proptest::test_runner::{Config, TestCaseError, TestError};

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
    kills_mid_checkpoint: u64,
}

impl std::ops::AddAssign for Stats {
    fn add_assign(&mut self, o: Self) {
        self.cases += o.cases;
        self.ops += o.ops;
        self.clean_restarts += o.clean_restarts;
        self.kills += o.kills;
        self.kills_mid_op += o.kills_mid_op;
        self.checkpoints += o.checkpoints;
        self.kills_mid_checkpoint += o.kills_mid_checkpoint;
    }
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
            server.stop(kill);
        }
        let mut server = Server::start(self.dir.path(), &FLAGS);
        self.client = server.client().await;
        self.server = Some(server);
        self.model.check(&self.client, true, None).await;
    }

    async fn run(&mut self, op: &Op) {
        self.stats.ops += 1;
        match op {
            Op::Verify => {
                self.model.check(&self.client, false, None).await;
            }
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
                corrupt_nvme(self.dir.path(), u64::from(*block) * 4096 + u64::from(*offset), 0x5a);
                self.model.corruptions += 1;
                // Reading finds the page the block held (if only its NVMe
                // copy is left); later restarts must keep it gone for that.
                self.model.check(&self.client, false, None).await;
            }
            Op::KillDuring { op, us } => {
                self.stats.kills_mid_op += 1;
                let planned = plan(&self.model, op, 0);
                let task = planned.clone().map(|p| tokio::spawn(send(p, self.client.clone())));
                tokio::time::sleep(Duration::from_micros(u64::from(*us))).await;
                if let Some(server) = self.server.take() {
                    server.kill();
                }
                if let (Some(planned), Some(task)) = (planned, task) {
                    let answer = task.await.unwrap();
                    if let Err(e) = apply(&mut self.model, &planned, &answer, answer.is_ok()) {
                        self.model.findings.violation(e);
                    }
                }
                self.restart(true).await;
            }
            op => {
                let Some(planned) = plan(&self.model, op, 0) else {
                    return;
                };
                let answer = send(planned.clone(), self.client.clone()).await;
                if let Err(e) = apply(&mut self.model, &planned, &answer, true) {
                    self.model.findings.violation(e);
                }
                if let (Planned::Policy { id, layer, change, .. }, Ok(_)) = (&planned, &answer) {
                    // Which pages a policy picks is its business: adopt the
                    // changes it made on its layer, as long as they are its
                    // action's.
                    let adopt = change.map(|c| (*id, *layer, c.fate(pb::Reason::Policy)));
                    self.model.check(&self.client, false, adopt).await;
                }
            }
        }
    }

    /// Counts what the servers' logs say happened in the background.
    fn count_logs(&mut self) {
        let (written, killed_during) = common::checkpoints(self.dir.path());
        self.stats.checkpoints += written as u64;
        self.stats.kills_mid_checkpoint += killed_during as u64;
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

#[test]
fn random_operations_crashes_and_restarts_lose_nothing_acknowledged() {
    let cases = env("KVTIER_CRASH_CASES").unwrap_or(32) as u32;
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
    let mut runner = seeded(config, seed, 0);
    let total = std::sync::Mutex::new(Stats::default());
    let started = Instant::now();
    let result = runner.run(&proptest::collection::vec(op(), 10..40), |ops| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let stats = runtime.block_on(run_case(ops)).map_err(TestCaseError::fail)?;
        *total.lock().unwrap() += stats;
        Ok(())
    });
    let t = total.into_inner().unwrap();
    println!(
        "{} cases, {} operations, {} clean restarts, {} kills (idle), {} kills mid-operation, \
         {} checkpoints written ({} kills during one), in {:.1} s",
        t.cases,
        t.ops,
        t.clean_restarts,
        t.kills,
        t.kills_mid_op,
        t.checkpoints,
        t.kills_mid_checkpoint,
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
