//! FetchPages: pages by (layer, KV-head range, page list) with their state,
//! in chunks of bounded size.

use std::ops::Range;
use std::time::Instant;

use kvtier_core::{Layout, LogicalPage, PageState, SequenceKey, parallel, wire};

use super::{Store, micros};
use crate::catalog::{HeadRange, Sequence};
use crate::page::StoreLane;
use crate::page_buf::PageBuf;
use crate::reader::{PageContent, room_for};
use crate::stats::Counters;
use crate::{StoreError, StoreResult};

/// A FetchPages request: which pages of one layer to read back.
#[derive(Debug, Clone, Copy)]
pub struct FetchPages<'a> {
    /// The layer to read.
    pub layer: u32,
    /// The KV heads to read, one lane each.
    pub heads: HeadRange,
    /// Which pages of each head's lane.
    pub pages: PageList<'a>,
    /// Also return each page's digest.
    pub with_digests: bool,
}

/// Which pages of each head a fetch reads.
#[derive(Debug, Clone, Copy)]
pub enum PageList<'a> {
    /// Every page of every head.
    All,
    /// These pages of every head.
    Same(&'a [u32]),
    /// One list per head of the range, in order (what a selection chose).
    PerHead(&'a [Vec<u32>]),
}

impl<'a> PageList<'a> {
    /// The list for the `i`-th head of the range; `None` means all pages.
    fn of(&self, i: usize) -> Option<&'a [u32]> {
        match *self {
            PageList::All => None,
            PageList::Same(pages) => Some(pages),
            PageList::PerHead(lists) => Some(&lists[i]),
        }
    }

    /// The protobuf field path of entry `j` of head `i`'s list.
    fn field(&self, i: usize, j: usize) -> String {
        match self {
            PageList::PerHead(_) => wire::per_head_page(i, j),
            _ => wire::PAGES.at(j),
        }
    }
}

/// A page as read: its bytes owned (`Vec<u8>`) or a range of the
/// [`PageBuf`] the read filled.
#[derive(Debug, Clone, PartialEq)]
pub struct FetchedPage<B = Vec<u8>> {
    /// The KV head whose lane the page is in.
    pub kv_head: u32,
    /// The page's number in its lane.
    pub page: u32,
    /// The page's state when it was read.
    pub state: PageState,
    /// Valid token rows of the page (the last page may be partial).
    pub rows: u32,
    /// Its original rows, its summary, or why it is gone.
    pub content: PageContent<B>,
    /// The page's key digest (min row, then max row), when asked for.
    pub digest: Option<Vec<u8>>,
}

impl<B> FetchedPage<B> {
    /// The same page with its bytes mapped by `f`.
    pub fn map<C>(self, f: impl FnOnce(B) -> C) -> FetchedPage<C> {
        FetchedPage {
            kv_head: self.kv_head,
            page: self.page,
            state: self.state,
            rows: self.rows,
            content: self.content.map(f),
            digest: self.digest,
        }
    }
}

impl FetchedPage<Range<usize>> {
    /// The page with its bytes copied out of `buf`, which a read filled.
    pub(crate) fn owned(self, buf: &PageBuf<'_>) -> FetchedPage {
        self.map(|r| buf.filled()[r].to_vec())
    }
}

/// A chunk of a fetch read into a [`PageBuf`], and where the next starts.
pub type FetchedChunk = (Vec<FetchedPage<Range<usize>>>, Option<FetchCursor>);

/// Where a chunked fetch resumes: the `head`-th head of the range, the
/// `index`-th page of its list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FetchCursor {
    /// The head's position in the request's range (0: its first head), not
    /// its KV head number.
    pub head: usize,
    /// The position in that head's page list (or its page number, for
    /// [`PageList::All`]).
    pub index: usize,
}

impl Store {
    /// Reads pages bit-exact as written. Summaries come back as summaries and
    /// gone pages as a per-page status; neither fails the call.
    pub fn fetch_pages(&self, key: &SequenceKey, req: FetchPages<'_>) -> StoreResult<Vec<FetchedPage>> {
        self.catalog.read(key, |seq| {
            let lanes = check_fetch(seq, &req)?;
            let (chosen, _, bytes) = chunk(seq, &req, &lanes, FetchCursor::default(), usize::MAX, usize::MAX);
            let mut room = Vec::with_capacity(bytes);
            let mut buf = PageBuf::new(room.spare_capacity_mut());
            let pages = self.read_chunk(seq, &req, &chosen, &mut buf)?;
            Ok(pages.into_iter().map(|p| p.owned(&buf)).collect())
        })
    }

    /// Reads the pages from `from` on, until their cost would pass
    /// `max_bytes` or their bytes the room left in `buf` (at least one
    /// page), each page's bytes straight into `buf`; says where to resume,
    /// so large reads stream in bounded memory.
    pub fn fetch_chunk_into(
        &self,
        key: &SequenceKey,
        req: FetchPages<'_>,
        from: FetchCursor,
        max_bytes: usize,
        buf: &mut PageBuf<'_>,
    ) -> StoreResult<FetchedChunk> {
        self.catalog.read(key, |seq| {
            let lanes = check_fetch(seq, &req)?;
            let (chosen, cursor, _) = chunk(seq, &req, &lanes, from, max_bytes, buf.remaining());
            let pages = self.read_chunk(seq, &req, &chosen, buf)?;
            let more = cursor.head < lanes.len();
            Ok((pages, more.then_some(cursor)))
        })
    }

    /// Reads the chosen (KV head, lane, page)s into `buf`.
    fn read_chunk(
        &self,
        seq: &Sequence,
        req: &FetchPages<'_>,
        chosen: &[(u32, usize, usize)],
        buf: &mut PageBuf<'_>,
    ) -> StoreResult<Vec<FetchedPage<Range<usize>>>> {
        let start = Instant::now();
        // The chosen pages come lane by lane: one run each.
        let pages: Vec<usize> = chosen.iter().map(|&(_, _, p)| p).collect();
        let mut at = 0;
        let runs: Vec<(&StoreLane, &[usize])> = chosen
            .chunk_by(|a, b| a.1 == b.1)
            .map(|run| {
                at += run.len();
                (&seq.lanes[run[0].1], &pages[at - run.len()..at])
            })
            .collect();
        let before = buf.used();
        let read_back = self.read_runs(&seq.layout, &runs, buf)?;
        let out = chosen
            .iter()
            .zip(read_back)
            .map(|(&(h, l, p), (state, content))| FetchedPage {
                kv_head: h,
                page: p as u32,
                state,
                rows: seq.lanes[l].rows_in(p),
                content,
                digest: req.with_digests.then(|| seq.lanes[l].digests().entry(p).to_vec()),
            })
            .collect::<Vec<FetchedPage<Range<usize>>>>();
        Counters::add(&self.counters.bytes_read, (buf.used() - before) as u64);
        if let Some(tracer) = self.tracer(seq) {
            let states = out.iter().map(|p| p.state);
            tracer.fetch(seq, req.layer, chosen, states, micros(start.elapsed()));
        }
        Ok(out)
    }
}

/// A page as [`Store::read_runs`] read it: its state, and its content in
/// the buffer.
type ReadPage = (PageState, PageContent<Range<usize>>);

impl Store {
    /// Reads runs of pages, each of one lane, into `buf` one after another
    /// (each run per head, where `buf` lays them out so); every page's
    /// state and content, in order. When there are
    /// enough bytes the runs are shared out over the cores, each share into
    /// its own stretch of `buf` (in memory a read is a copy bound by memory
    /// bandwidth, which one core does not saturate); each share is one
    /// reader call, so its NVMe pages go out as one batch. Marks the hot
    /// pages read as used.
    pub(super) fn read_runs(
        &self,
        layout: &Layout,
        runs: &[(&StoreLane, &[usize])],
        buf: &mut PageBuf<'_>,
    ) -> StoreResult<Vec<ReadPage>> {
        let room: Vec<usize> = runs
            .iter()
            .map(|(lane, pages)| pages.iter().map(|&p| room_for(layout, lane, p)).sum())
            .collect();
        buf.declare_runs(&room)?;
        let threads = parallel::threads_for(runs.len(), room.iter().sum(), parallel::cores());
        let share = runs.len().div_ceil(threads).max(1);
        let shares: Vec<&[(&StoreLane, &[usize])]> = runs.chunks(share).collect();
        let share_room: Vec<usize> = room.chunks(share).map(|r| r.iter().sum()).collect();
        let mut parts: Vec<_> = buf.split(&share_room)?.into_iter().zip(shares).collect();
        let reader = self.reader();
        let read = parallel::map_mut(&mut parts, threads, |(part, share)| {
            let items: Vec<(&StoreLane, usize)> = share
                .iter()
                .flat_map(|(lane, pages)| pages.iter().map(|&p| (*lane, p)))
                .collect();
            let mut hot = Vec::new();
            let contents = reader.contents(layout, &items, &mut hot, part)?;
            part.zero_rest()?;
            Ok::<_, StoreError>((contents, hot))
        });
        let mut hot = Vec::new();
        let mut out = Vec::new();
        for result in read {
            let (contents, share_hot) = result?;
            hot.extend(share_hot);
            out.extend(contents);
        }
        self.device.touch(&hot);
        Ok(out)
    }
}

/// The (KV head, lane) pairs a fetch reads, after checking its page lists.
fn check_fetch(seq: &Sequence, req: &FetchPages<'_>) -> StoreResult<Vec<(u32, usize)>> {
    seq.check_layer(req.layer)?;
    let heads = seq.check_heads(req.heads)?;
    let lanes: Vec<(u32, usize)> = seq.lanes_of(req.layer, heads).collect();
    if let PageList::PerHead(lists) = req.pages
        && lists.len() != lanes.len()
    {
        return Err(StoreError::invalid(
            wire::PER_HEAD_PAGES,
            format!(
                "has {} lists for {} KV heads; give one per head",
                lists.len(),
                lanes.len()
            ),
        ));
    }
    for (i, &(h, lane)) in lanes.iter().enumerate() {
        let held = seq.lanes[lane].num_pages();
        if let Some((j, p)) = req
            .pages
            .of(i)
            .and_then(|l| l.iter().enumerate().find(|(_, p)| **p as usize >= held))
        {
            return Err(StoreError::invalid(
                req.pages.field(i, j),
                format!("is {p}, but layer {} KV head {h} holds {held} pages", req.layer),
            ));
        }
    }
    Ok(lanes)
}

/// What a fetched page costs beyond its bytes: its `FetchedPage` and its
/// message's fields, about.
const PAGE_OVERHEAD: usize = 64;

/// The (KV head, lane, page) a chunk reads from `from` on, stopping before
/// what they cost would pass `max_bytes` or their bytes `room` (at least
/// one page), where the next chunk starts, and the chosen pages' bytes.
/// The two are apart: a buffer sized to the pages' bytes holds them all,
/// though their cost is more.
fn chunk(
    seq: &Sequence,
    req: &FetchPages<'_>,
    lanes: &[(u32, usize)],
    from: FetchCursor,
    max_bytes: usize,
    room: usize,
) -> (Vec<(u32, usize, usize)>, FetchCursor, usize) {
    let mut chosen = Vec::new();
    let mut bytes = 0usize;
    let mut page_bytes = 0usize;
    let mut cursor = from;
    while let Some(&(h, lane_index)) = lanes.get(cursor.head) {
        let lane = &seq.lanes[lane_index];
        let list = req.pages.of(cursor.head);
        let count = list.map_or(lane.num_pages(), <[u32]>::len);
        while cursor.index < count {
            let p = list.map_or(cursor.index as u32, |pages| pages[cursor.index]) as usize;
            // Every page costs something in memory and on the wire, gone
            // ones too (a list naming one gone page millions of times must
            // still come in chunks); digests and summaries' counts count.
            let digest = if req.with_digests {
                2 * seq.layout.row_bytes()
            } else {
                0
            };
            let kv = room_for(&seq.layout, lane, p);
            let counts = match lane.page(p) {
                Some(LogicalPage::Summary(s)) => 4 * s.counts.len(),
                _ => 0,
            };
            let size = PAGE_OVERHEAD + digest + kv + counts;
            if !chosen.is_empty() && (bytes + size > max_bytes || page_bytes + kv > room) {
                return (chosen, cursor, page_bytes);
            }
            bytes += size;
            page_bytes += kv;
            chosen.push((h, lane_index, p));
            cursor.index += 1;
        }
        cursor = FetchCursor {
            head: cursor.head + 1,
            index: 0,
        };
    }
    (chosen, cursor, page_bytes)
}
