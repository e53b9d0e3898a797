//! Reading access traces — recorded by the server (`--access-trace`,
//! `SetAccessTrace`) or by `kvtier bench decode --trace`; the format is
//! `kvtier_store::TraceRecord`'s — for `kvtier tune` and `kvtier bench
//! fetch`.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::Path;

use anyhow::{Context, bail, ensure};
use kvtier_store::{Access, TRACE_FORMAT, TraceHeader, TraceRecord};

use crate::shape::Shape;

/// One access of a trace, its sequence numbered in order of appearance.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub(crate) sequence: usize,
    pub(crate) write: bool,
    pub(crate) access: Access,
}

#[derive(Debug)]
pub(crate) struct Trace {
    pub(crate) header: TraceHeader,
    /// Each sequence's shape, in order of appearance (a name dropped and
    /// created again counts twice).
    pub(crate) shapes: Vec<Shape>,
    /// Each sequence's prefix chain (salted hashes, one per leading page:
    /// see `TraceRecord::Sequence`), in the same order.
    pub(crate) prefixes: Vec<Vec<u64>>,
    /// Sequences dropped: (how many events came before the drop, the
    /// sequence), in order.
    pub(crate) drops: Vec<(usize, usize)>,
    /// Reads and writes, in the order recorded.
    pub(crate) events: Vec<Event>,
    /// Why the recording stopped early, and how many records it dropped.
    pub(crate) ended: Option<(String, u64)>,
}

impl Trace {
    /// Reads and checks a trace: every access names a sequence described
    /// before it, and stays inside that sequence's shape.
    pub(crate) fn read(path: &Path) -> anyhow::Result<Self> {
        let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let mut lines = std::io::BufReader::new(file).lines();
        let first = lines.next().context("an empty trace")??;
        let header: TraceHeader = serde_json::from_str(&first).with_context(|| {
            format!(
                "{}: line 1 is not a kvtier trace header (format {TRACE_FORMAT}; record the trace again with this kvtier)",
                path.display()
            )
        })?;
        // Formats 3 and 4 differ from 2 only by the background's `round`
        // records, which 3 has and a replay ignores.
        ensure!(
            (2..=TRACE_FORMAT).contains(&header.kvtier_trace),
            "{}: format {} (this kvtier reads 2 to {TRACE_FORMAT}); record it again",
            path.display(),
            header.kvtier_trace
        );
        ensure!(
            header.sample > 0.0 && header.sample <= 1.0,
            "{}: sample {} is not in (0, 1]",
            path.display(),
            header.sample
        );
        let mut trace = Trace {
            header,
            shapes: Vec::new(),
            prefixes: Vec::new(),
            drops: Vec::new(),
            events: Vec::new(),
            ended: None,
        };
        let mut index: HashMap<u64, usize> = HashMap::new();
        for (i, line) in lines.enumerate() {
            let at = || format!("{} line {}", path.display(), i + 2);
            let record: TraceRecord = serde_json::from_str(&line?).with_context(at)?;
            let (write, access) = match record {
                TraceRecord::Sequence {
                    seq,
                    shape,
                    dtype,
                    page_size,
                    prefix,
                } => {
                    ensure!(!index.contains_key(&seq), "{}: sequence {seq} described twice", at());
                    index.insert(seq, trace.shapes.len());
                    trace
                        .shapes
                        .push(Shape::custom(shape, &dtype, page_size).with_context(at)?);
                    trace.prefixes.push(prefix);
                    continue;
                }
                TraceRecord::Round { .. } => continue,
                TraceRecord::End { reason, dropped } => {
                    trace.ended = Some((reason, dropped));
                    continue;
                }
                // A sequence created again under the name is another one.
                TraceRecord::Drop { seq, .. } => {
                    if let Some(sequence) = index.remove(&seq) {
                        trace.drops.push((trace.events.len(), sequence));
                    }
                    continue;
                }
                TraceRecord::Read(a) => (false, a),
                TraceRecord::Write(a) => (true, a),
            };
            let Some(&sequence) = index.get(&access.seq) else {
                bail!("{}: sequence {} has no `sequence` record before it", at(), access.seq);
            };
            let shape = &trace.shapes[sequence];
            ensure!(
                access.layer < shape.layers
                    && access
                        .heads
                        .iter()
                        .all(|h| h.head < shape.kv_heads && (h.from.is_empty() || h.from.len() == h.pages.len())),
                "{}: outside its sequence's shape",
                at()
            );
            trace.events.push(Event {
                sequence,
                write,
                access,
            });
        }
        ensure!(
            trace.events.iter().any(|e| !e.write),
            "{}: the trace has no reads",
            path.display()
        );
        Ok(trace)
    }
}
