//! `DrainNode`: every sequence this node owns goes to the node placement
//! gives it, a few at a time, each reported as it ends. A drain marks the
//! node draining first (placement then skips it, so every sequence has a
//! new owner) and, once the node holds nothing, leaves the cluster and
//! stops the server; with `stay` only sequences placed elsewhere move (a
//! rebalance), and a draining node serves again.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvtier_cluster::{NodeState, placement};
use kvtier_core::SequenceKey;
use kvtier_proto::v1 as pb;
use kvtier_proto::v1::drain_progress::Event;
use tokio::sync::{Semaphore, mpsc};

use super::Mover;
use super::gate::Peer;
use super::send::{Carried, send};

/// Runs a drain (or with `stay`, a rebalance), reporting on `progress`;
/// it goes on if the caller goes away.
pub(crate) async fn drain(m: Arc<Mover>, stay: bool, parallel: usize, progress: mpsc::Sender<pb::DrainProgress>) {
    let started = Instant::now();
    let done = |moved, failed, bytes, left| pb::DrainProgress {
        event: Some(Event::Done(pb::DrainDone {
            moved,
            failed,
            bytes,
            millis: started.elapsed().as_millis() as u64,
            left,
        })),
    };
    let marked = match (stay, m.node.state()) {
        (false, _) => m.node.set_draining(true).await,
        (true, NodeState::Draining) => m.node.set_draining(false).await,
        (true, _) => Ok(()),
    };
    if let Err(e) = marked {
        let failed = failed_all(&m, format!("cannot mark the node in etcd: {e}"));
        let count = failed.len() as u32;
        report(&progress, failed).await;
        let _ = progress.send(done(0, count, 0, false)).await;
        m.draining.store(false, Ordering::Release);
        return;
    }
    let keys: Vec<SequenceKey> = m.node.owned().into_iter().filter(|k| m.store.holds(k)).collect();
    tracing::info!(
        sequences = keys.len(),
        stay,
        "moving this node's sequences to their placement"
    );
    let slots = Arc::new(Semaphore::new(parallel));
    let (results_tx, mut results) = mpsc::unbounded_channel();
    for key in keys {
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            break;
        };
        let (m, tx) = (Arc::clone(&m), results_tx.clone());
        tokio::spawn(async move {
            let result = move_one(&m, &key, stay).await;
            drop(slot);
            let _ = tx.send(result);
        });
    }
    drop(results_tx);
    let (mut moved, mut failed, mut bytes) = (0, 0, 0);
    while let Some(result) = results.recv().await {
        let Some(one) = result else { continue };
        if one.error.is_empty() {
            moved += 1;
            bytes += one.bytes;
        } else {
            failed += 1;
        }
        report(&progress, vec![one]).await;
    }
    let left = !stay && failed == 0 && m.node.owned().is_empty();
    if left {
        m.node.leave_empty().await;
        let _ = m.drained.send(true);
    }
    tracing::info!(
        moved,
        failed,
        bytes,
        ms = started.elapsed().as_millis() as u64,
        left,
        "drain ended"
    );
    let _ = progress.send(done(moved, failed, bytes, left)).await;
    m.draining.store(false, Ordering::Release);
}

/// Moves one sequence to its placement; `None` when it stays by rule (a
/// rebalance finds it placed here).
async fn move_one(m: &Arc<Mover>, key: &SequenceKey, stay: bool) -> Option<pb::SequenceMoved> {
    let started = Instant::now();
    let mut report = pb::SequenceMoved {
        tenant: key.tenant.as_str().to_owned(),
        sequence_id: key.sequence.as_str().to_owned(),
        ..pb::SequenceMoved::default()
    };
    let to = match target(m, key).await {
        Ok(to) => to,
        Err(e) => {
            report.error = e;
            return Some(report);
        }
    };
    if stay && to.node_id == m.node.id() {
        return None;
    }
    report.to_node = to.node_id.clone();
    let carried = Arc::new(Carried::default());
    if let Err(e) = send(m, key, &to, &carried).await {
        tracing::warn!(sequence = %key, to = %to.node_id, error = %e, "a sequence did not move");
        report.error = e;
    }
    report.pages = carried.pages.load(Ordering::Relaxed);
    report.bytes = carried.bytes.load(Ordering::Relaxed);
    report.micros = started.elapsed().as_micros() as u64;
    Some(report)
}

/// The node placement gives `key` now (its group and hash chain place it
/// as its create did).
async fn target(m: &Mover, key: &SequenceKey) -> Result<Peer, String> {
    let record = m
        .node
        .ownership(key)
        .await
        .map_err(|e| format!("etcd: {e}"))?
        .ok_or("it has no ownership record")?
        .record;
    let hashes = m.store.prefix_hashes(key).map_err(|e| e.to_string())?;
    let view = m.node.view();
    let placed = view.placed(placement(
        key.tenant.as_str(),
        key.sequence.as_str(),
        &hashes,
        record.group.as_ref(),
    ));
    placed
        .map(Peer::of)
        .ok_or_else(|| "no other node is serving".to_owned())
}

/// Every owned sequence reported as not moved, for `why`.
fn failed_all(m: &Mover, why: String) -> Vec<pb::SequenceMoved> {
    m.node
        .owned()
        .into_iter()
        .map(|k| pb::SequenceMoved {
            tenant: k.tenant.as_str().to_owned(),
            sequence_id: k.sequence.as_str().to_owned(),
            error: why.clone(),
            ..pb::SequenceMoved::default()
        })
        .collect()
}

async fn report(progress: &mpsc::Sender<pb::DrainProgress>, moved: Vec<pb::SequenceMoved>) {
    for one in moved {
        let message = pb::DrainProgress {
            event: Some(Event::Sequence(one)),
        };
        // The caller may have gone; the drain goes on.
        if tokio::time::timeout(Duration::from_secs(1), progress.send(message))
            .await
            .is_err()
        {
            tracing::debug!("drain progress not delivered");
        }
    }
}
