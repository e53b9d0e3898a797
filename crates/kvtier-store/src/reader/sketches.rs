//! The sketches a lane's index spilled (those of NVMe-cold pages), derived
//! again for a ranking from the pages' key rows wherever they are: one
//! CRC-checked NVMe batch per call, with no host copy made (ranking is not
//! a use of the page).

use kvtier_core::rank::ColdSketches;
use kvtier_core::{Layout, LogicalPage, sketch};
use kvtier_sync::{Mutex, Rank};

use super::Reader;
use crate::page::StoreLane;

/// One lane's spilled sketches, read through `reader`.
#[derive(Debug)]
pub(crate) struct LaneSketches<'a> {
    pub(crate) reader: Reader<'a>,
    pub(crate) layout: &'a Layout,
    pub(crate) lane: &'a StoreLane,
    /// The sketches derived so far, by page: a ranking gives them back to
    /// the index (through the sequence's next writer), so that the next
    /// step's candidates, mostly the same, are not read again.
    derived: Mutex<Vec<(usize, Vec<u8>)>>,
}

impl<'a> LaneSketches<'a> {
    pub(crate) fn new(reader: Reader<'a>, layout: &'a Layout, lane: &'a StoreLane) -> Self {
        Self {
            reader,
            layout,
            lane,
            derived: Mutex::new(Rank::DerivedSketches, Vec::new()),
        }
    }

    /// The sketches derived so far, by page.
    pub(crate) fn take_derived(&self) -> Vec<(usize, Vec<u8>)> {
        std::mem::take(&mut *self.derived.lock())
    }
}

impl LaneSketches<'_> {
    /// Each page's first key rows (`rows_in(p)` rows), or `None` where the
    /// page holds no original bytes (lost, summarised, gone).
    pub(crate) fn keys(&self, pages: &[usize]) -> Vec<Option<Vec<u8>>> {
        let mut at = Vec::with_capacity(pages.len());
        let mut wanted = Vec::with_capacity(pages.len());
        for (i, &p) in pages.iter().enumerate() {
            if let Some(LogicalPage::Physical(r)) = self.lane.page(p) {
                at.push(i);
                wanted.push((std::sync::Arc::clone(&r.page), self.lane.rows_in(p)));
            }
        }
        let mut out = vec![None; pages.len()];
        let reader = Reader {
            promote: false,
            touch: false,
            ..self.reader
        };
        match reader.originals(self.layout, &wanted) {
            Ok(read) => {
                for ((i, (_, rows)), kv) in at.into_iter().zip(&wanted).zip(read) {
                    out[i] = kv.map(|mut kv| {
                        kv.truncate(*rows as usize * self.layout.row_bytes());
                        kv
                    });
                }
            }
            Err(e) => tracing::error!(error = %e, "spilled sketches could not be read; ranked as zero keys"),
        }
        out
    }
}

impl ColdSketches for LaneSketches<'_> {
    fn sketches(&self, pages: &[usize]) -> Vec<Option<Vec<u8>>> {
        let (dtype, d) = (self.layout.dtype(), self.layout.head_dim() as usize);
        let out: Vec<Option<Vec<u8>>> = self
            .keys(pages)
            .into_iter()
            .map(|keys| keys.map(|k| sketch::encode(dtype, d, &k)))
            .collect();
        let mut derived = self.derived.lock();
        derived.extend(pages.iter().zip(&out).filter_map(|(&p, s)| Some((p, s.clone()?))));
        out
    }
}
