//! Kill -9 the real server again and again over one data directory while
//! several writers work on it at once: appends and puts with and without
//! persist, evictions, summaries, moves, policies and drops, with tiny tiers
//! (pages migrate to NVMe all the time) and a checkpoint whenever the
//! manifest has doubled. After every restart each writer checks its
//! sequences against its model (`common/model.rs`): nothing acknowledged
//! durable is lost, every byte served is the byte written at its position,
//! and every acknowledged fate survives.
//!
//! `KVTIER_SOAK_CYCLES` (default 6), `KVTIER_SOAK_WRITERS` (default 4) and
//! `KVTIER_SOAK_SEED` size it; `KVTIER_SOAK_OUT` names a JSON file for the
//! counts (`bench/soak.sh` runs it long against the release binary).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::model::{Findings, Model};
use common::ops::{Op, Planned, apply, op, plan, send};
use common::{FLAGS, Server, env, seeded};
use kvtier_client::{Client, pb};
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, TestRunner};

/// One writer: its own sequences (names from `base` on, in both tenants),
/// their model, and its random source.
struct Writer {
    base: u8,
    model: Model,
    runner: TestRunner,
    acked: u64,
}

impl Writer {
    fn new(index: u8, seed: u64) -> Self {
        Self {
            base: 3 * index,
            model: Model::default(),
            runner: seeded(Config::default(), seed, index),
            acked: 0,
        }
    }

    fn next_op(&mut self) -> Op {
        match op().new_tree(&mut self.runner).unwrap().current() {
            Op::KillDuring { op, .. } => *op,
            op => op,
        }
    }

    /// Works until the server is killed; the request the kill cuts off
    /// counts as maybe done.
    async fn work(mut self, client: Client, killed: Arc<AtomicBool>) -> Self {
        loop {
            let op = self.next_op();
            let Some(planned) = plan(&self.model, &op, self.base) else {
                continue;
            };
            let answer = send(planned.clone(), client.clone()).await;
            let cut_off = answer.is_err() && killed.load(Ordering::Acquire);
            if let Err(e) = apply(&mut self.model, &planned, &answer, !cut_off) {
                self.model.findings.violation(e);
            }
            if cut_off || killed.load(Ordering::Acquire) {
                return self;
            }
            self.acked += 1;
            if let (Planned::Policy { id, layer, change, .. }, Ok(_)) = (&planned, &answer) {
                // Adopt the pages it chose; a kill in the middle of reading
                // them leaves the rest as maybe changed.
                let fate = change.map(|c| c.fate(pb::Reason::Policy));
                let before = self.model.findings.clone();
                self.model.check(&client, false, fate.map(|f| (*id, *layer, f))).await;
                if killed.load(Ordering::Acquire) {
                    self.model.findings = before;
                    self.model.policy_unsure(*id, *layer, fate);
                    return self;
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_again_and_again_under_concurrent_writers_loses_nothing_acknowledged() {
    let cycles = env("KVTIER_SOAK_CYCLES").unwrap_or(6);
    let seed = env("KVTIER_SOAK_SEED").unwrap_or(1);
    // Kill timing: a stream of its own, apart from the writers'.
    let mut rng = seeded(Config::default(), seed, u8::MAX);
    let dir = tempfile::tempdir().unwrap();
    let writer_count = env("KVTIER_SOAK_WRITERS").unwrap_or(4);
    let mut writers: Vec<Writer> = (0..writer_count as u8).map(|i| Writer::new(i, seed)).collect();
    let started = Instant::now();
    for cycle in 0..cycles {
        let mut server = Server::start(dir.path(), &FLAGS);
        let client = server.client().await;
        for w in &mut writers {
            w.model.check(&client, cycle > 0, None).await;
        }
        let killed = Arc::new(AtomicBool::new(false));
        let tasks: Vec<_> = writers
            .drain(..)
            .map(|w| tokio::spawn(w.work(client.clone(), Arc::clone(&killed))))
            .collect();
        let ms = (100u64..700).new_tree(&mut rng).unwrap().current();
        tokio::time::sleep(Duration::from_millis(ms)).await;
        killed.store(true, Ordering::Release);
        server.kill();
        for task in tasks {
            writers.push(task.await.unwrap());
        }
    }
    // A last restart after the last kill, then a clean one: both checked.
    let mut server = Server::start(dir.path(), &FLAGS);
    let client = server.client().await;
    for w in &mut writers {
        w.model.check(&client, true, None).await;
    }
    server.terminate();
    let mut server = Server::start(dir.path(), &FLAGS);
    let client = server.client().await;
    let mut last = Findings::default();
    for w in &mut writers {
        last.merge(w.model.check(&client, true, None).await);
    }
    server.terminate();

    let mut total = Findings::default();
    let (mut acked, mut durable_writes) = (0, 0);
    for w in writers {
        acked += w.acked;
        durable_writes += w.model.durable_writes;
        total.merge(w.model.findings);
    }
    let (checkpoints, killed_mid_checkpoint) = common::checkpoints(dir.path());
    let report = serde_json::json!({
        "cycles": cycles,
        "writers": writer_count,
        "seed": seed,
        "seconds": started.elapsed().as_secs_f64(),
        "operations_acknowledged": acked,
        "durable_writes_acknowledged": durable_writes,
        "checkpoints_written": checkpoints,
        "kills_during_a_checkpoint": killed_mid_checkpoint,
        "durable_rows_lost": total.durable_rows_lost,
        "wrong_bytes_pages": total.wrong_bytes,
        "fates_changed": total.fate_changed,
        "other_violations": total.other,
        "pages_read_by_state": total.pages_by_state,
        "pages_at_the_end_by_state": last.pages_by_state,
        "first_violations": total.messages,
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    if let Ok(path) = std::env::var("KVTIER_SOAK_OUT") {
        std::fs::write(path, serde_json::to_string_pretty(&report).unwrap()).unwrap();
    }
    assert_eq!(total.violations(), 0, "{}", total.messages.join("\n"));
    assert!(durable_writes > 0, "no durable write was acknowledged");
}
