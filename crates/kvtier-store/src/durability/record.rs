//! The manifest's records and their byte format.
//!
//! A manifest file is a sequence of frames `[len u32][crc32c u32][payload]`,
//! little-endian. The first record of every file is a [`Record::Header`];
//! replay stops at the first frame that is short or fails its CRC (a torn
//! tail). Every record *sets* something (a sequence, a logical page, a
//! physical page's copy) rather than changing it by a delta, so replaying a
//! record whose effect a checkpoint already holds changes nothing.

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

use kvtier_core::{DType, LayerGroup, Layout, LayoutSpec, Reason, SequenceKey};

use super::ManifestError;

/// The format written by this version; a file of another version is refused.
pub(crate) const FORMAT_VERSION: u32 = 3;

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Record {
    /// First in every file.
    Header {
        version: u32,
    },
    /// Page ids below `next` may have been given out: never give them again.
    Ids {
        next: u64,
    },
    /// A sequence (re)starts empty.
    Sequence {
        key: SequenceKey,
        layout: Layout,
        hashes: Vec<Vec<u8>>,
    },
    Drop {
        key: SequenceKey,
    },
    /// The logical page maps to physical page `phys`; its digest when it
    /// was full.
    Map {
        at: PageAt,
        phys: u64,
        digest: Vec<u8>,
    },
    /// The logical page is gone: evicted, or its bytes lost.
    Gone {
        at: PageAt,
        reason: Reason,
        digest: Vec<u8>,
    },
    /// The logical page is a summary: `counts.len()` rows, K then V, in `kv`.
    Summary {
        at: PageAt,
        reason: Reason,
        digest: Vec<u8>,
        counts: Vec<u32>,
        kv: Vec<u8>,
    },
    /// Physical page `phys` has an NVMe copy of its first `rows` rows.
    Persist {
        phys: u64,
        offset: u64,
        len: u64,
        crc: u32,
        rows: u32,
        digest: Vec<u8>,
    },
    /// Physical page `phys` no longer has one (freed, or its copy replaced
    /// by a later `Persist`).
    Unpersist {
        phys: u64,
    },
    /// Physical page `phys` lost its bytes (a failed CRC or read): every
    /// logical page mapping it is gone with `reason`, for good.
    Lost {
        phys: u64,
        reason: Reason,
    },
}

/// A logical page: page `page` of lane `lane` of sequence `key`, holding
/// `rows` tokens when the record was written.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PageAt {
    pub(crate) key: SequenceKey,
    pub(crate) lane: u32,
    pub(crate) page: u32,
    pub(crate) rows: u32,
}

struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, v: &[u8]) {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
    }
    fn key(&mut self, k: &SequenceKey) {
        self.bytes(k.tenant.as_str().as_bytes());
        self.bytes(k.sequence.as_str().as_bytes());
    }
    fn page_at(&mut self, at: &PageAt) {
        self.key(&at.key);
        self.u32(at.lane);
        self.u32(at.page);
        self.u32(at.rows);
    }
}

struct Reader<'a>(&'a [u8]);

type Decoded<T> = Result<T, &'static str>;

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Decoded<&[u8]> {
        if self.0.len() < n {
            return Err("record too short");
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Decoded<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Decoded<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| "u32")?))
    }
    fn u64(&mut self) -> Decoded<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| "u64")?))
    }
    fn bytes(&mut self) -> Decoded<Vec<u8>> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn string(&mut self) -> Decoded<String> {
        String::from_utf8(self.bytes()?).map_err(|_| "invalid UTF-8")
    }
    fn key(&mut self) -> Decoded<SequenceKey> {
        let (tenant, sequence) = (self.string()?, self.string()?);
        SequenceKey::parse(&tenant, &sequence).map_err(|_| "invalid sequence key")
    }
    fn page_at(&mut self) -> Decoded<PageAt> {
        Ok(PageAt {
            key: self.key()?,
            lane: self.u32()?,
            page: self.u32()?,
            rows: self.u32()?,
        })
    }
    fn reason(&mut self) -> Decoded<Reason> {
        Reason::ALL.get(self.u8()? as usize).copied().ok_or("unknown reason")
    }
}

/// A dtype's code on disk (fixed: the file outlives the enum's order).
fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Bf16 => 2,
    }
}

fn dtype_of(code: u8) -> Decoded<DType> {
    match code {
        0 => Ok(DType::F32),
        1 => Ok(DType::F16),
        2 => Ok(DType::Bf16),
        _ => Err("unknown dtype"),
    }
}

impl Record {
    fn encode(&self, w: &mut Writer<'_>) {
        match self {
            Record::Header { version } => {
                w.u8(0);
                w.u32(*version);
            }
            Record::Ids { next } => {
                w.u8(1);
                w.u64(*next);
            }
            Record::Sequence { key, layout, hashes } => {
                w.u8(2);
                w.key(key);
                let s = layout.spec();
                for v in [s.num_layers, s.num_kv_heads, s.num_query_heads, s.head_dim, s.page_size] {
                    w.u32(v);
                }
                w.u8(dtype_code(s.dtype));
                w.u32(s.layer_groups.len() as u32);
                for g in &s.layer_groups {
                    w.u32(g.first_layer);
                    w.u32(g.num_layers);
                }
                w.u32(hashes.len() as u32);
                for h in hashes {
                    w.bytes(h);
                }
            }
            Record::Drop { key } => {
                w.u8(3);
                w.key(key);
            }
            Record::Map { at, phys, digest } => {
                w.u8(4);
                w.page_at(at);
                w.u64(*phys);
                w.bytes(digest);
            }
            Record::Gone { at, reason, digest } => {
                w.u8(5);
                w.page_at(at);
                w.u8(reason.index() as u8);
                w.bytes(digest);
            }
            Record::Summary {
                at,
                reason,
                digest,
                counts,
                kv,
            } => {
                w.u8(6);
                w.page_at(at);
                w.u8(reason.index() as u8);
                w.bytes(digest);
                w.u32(counts.len() as u32);
                for c in counts {
                    w.u32(*c);
                }
                w.bytes(kv);
            }
            Record::Persist {
                phys,
                offset,
                len,
                crc,
                rows,
                digest,
            } => {
                w.u8(7);
                w.u64(*phys);
                w.u64(*offset);
                w.u64(*len);
                w.u32(*crc);
                w.u32(*rows);
                w.bytes(digest);
            }
            Record::Unpersist { phys } => {
                w.u8(8);
                w.u64(*phys);
            }
            Record::Lost { phys, reason } => {
                w.u8(9);
                w.u64(*phys);
                w.u8(reason.index() as u8);
            }
        }
    }

    fn decode(payload: &[u8]) -> Decoded<Self> {
        let mut r = Reader(payload);
        let record = match r.u8()? {
            0 => Record::Header { version: r.u32()? },
            1 => Record::Ids { next: r.u64()? },
            2 => {
                let key = r.key()?;
                let [num_layers, num_kv_heads, num_query_heads, head_dim, page_size] =
                    [r.u32()?, r.u32()?, r.u32()?, r.u32()?, r.u32()?];
                let dtype = dtype_of(r.u8()?)?;
                let groups = (0..r.u32()?)
                    .map(|_| {
                        Ok(LayerGroup {
                            first_layer: r.u32()?,
                            num_layers: r.u32()?,
                        })
                    })
                    .collect::<Decoded<_>>()?;
                let spec = LayoutSpec {
                    num_layers,
                    num_kv_heads,
                    num_query_heads,
                    head_dim,
                    dtype,
                    page_size,
                    layer_groups: groups,
                };
                let layout = Layout::new(spec).map_err(|_| "invalid layout")?;
                let hashes = (0..r.u32()?).map(|_| r.bytes()).collect::<Decoded<_>>()?;
                Record::Sequence { key, layout, hashes }
            }
            3 => Record::Drop { key: r.key()? },
            4 => Record::Map {
                at: r.page_at()?,
                phys: r.u64()?,
                digest: r.bytes()?,
            },
            5 => Record::Gone {
                at: r.page_at()?,
                reason: r.reason()?,
                digest: r.bytes()?,
            },
            6 => Record::Summary {
                at: r.page_at()?,
                reason: r.reason()?,
                digest: r.bytes()?,
                counts: (0..r.u32()?).map(|_| r.u32()).collect::<Decoded<_>>()?,
                kv: r.bytes()?,
            },
            7 => Record::Persist {
                phys: r.u64()?,
                offset: r.u64()?,
                len: r.u64()?,
                crc: r.u32()?,
                rows: r.u32()?,
                digest: r.bytes()?,
            },
            8 => Record::Unpersist { phys: r.u64()? },
            9 => Record::Lost {
                phys: r.u64()?,
                reason: r.reason()?,
            },
            _ => return Err("unknown record type"),
        };
        if !r.0.is_empty() {
            return Err("trailing bytes in record");
        }
        Ok(record)
    }
}

/// The frames of `records`: each one's length and CRC32C, then its bytes.
pub(crate) fn frame(records: &[Record]) -> Vec<u8> {
    let mut out = Vec::new();
    frame_into(records, &mut out);
    out
}

/// [`frame`], appended to `out`.
pub(crate) fn frame_into(records: &[Record], out: &mut Vec<u8>) {
    for record in records {
        let start = out.len();
        out.extend_from_slice(&[0; 8]);
        record.encode(&mut Writer(&mut *out));
        let len = (out.len() - start - 8) as u32;
        let crc = crc32c::crc32c(&out[start + 8..]);
        out[start..start + 4].copy_from_slice(&len.to_le_bytes());
        out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    }
}

/// The records of a manifest file up to the first torn or corrupt frame,
/// and the byte length of that valid prefix. A missing or empty file has
/// none; a file that does not start with this version's header is refused
/// rather than misread.
pub(crate) fn read_file(path: &Path) -> Result<(Vec<Record>, u64), ManifestError> {
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut f) => f
            .read_to_end(&mut bytes)
            .map_err(|e| ManifestError::io("read", path, e))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(ManifestError::io("open", path, e)),
    };
    let mut records = Vec::new();
    let mut at = 0usize;
    while let Some(head) = bytes.get(at..at + 8) {
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        let Some(payload) = bytes.get(at + 8..at + 8 + len) else {
            break;
        };
        if crc32c::crc32c(payload) != crc {
            break;
        }
        match Record::decode(payload) {
            Ok(r) => records.push(r),
            Err(why) => {
                tracing::warn!(offset = at, why, "manifest record unreadable; replay stops here");
                break;
            }
        }
        at += 8 + len;
    }
    match records.first() {
        None if bytes.is_empty() => {}
        None => tracing::warn!(bytes = bytes.len(), "manifest holds no complete record; starting empty"),
        Some(Record::Header {
            version: FORMAT_VERSION,
        }) => {}
        Some(Record::Header { version }) => {
            return Err(ManifestError::Format {
                path: path.to_owned(),
                why: format!(
                    "format version {version}; this kvtier reads version {FORMAT_VERSION} \
                     (version 3 added key sketches to every page's index): start with the data \
                     directory moved aside, or with the kvtier that wrote it"
                ),
            });
        }
        Some(_) => {
            return Err(ManifestError::Format {
                path: path.to_owned(),
                why: "no format header (written by a kvtier before format version 2)".to_owned(),
            });
        }
    }
    if at < bytes.len() {
        tracing::warn!(
            valid = at,
            total = bytes.len(),
            "manifest has a torn or corrupt tail; it is ignored"
        );
    }
    Ok((records, at as u64))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn key(s: &str) -> SequenceKey {
        SequenceKey::parse("t", s).unwrap()
    }

    pub(crate) fn at(s: &str, lane: u32, page: u32, rows: u32) -> PageAt {
        PageAt {
            key: key(s),
            lane,
            page,
            rows,
        }
    }

    /// One record of every kind.
    pub(crate) fn records() -> Vec<Record> {
        let layout = Layout::new(LayoutSpec {
            num_layers: 3,
            num_kv_heads: 2,
            num_query_heads: 4,
            head_dim: 8,
            dtype: DType::Bf16,
            page_size: 16,
            layer_groups: vec![LayerGroup {
                first_layer: 1,
                num_layers: 2,
            }],
        })
        .unwrap();
        vec![
            Record::Header {
                version: FORMAT_VERSION,
            },
            Record::Ids { next: 1 << 40 },
            Record::Sequence {
                key: key("a"),
                layout,
                hashes: vec![b"h0".to_vec(), vec![]],
            },
            Record::Map {
                at: at("a", 3, 7, 16),
                phys: 99,
                digest: vec![1, 2, 3],
            },
            Record::Persist {
                phys: 99,
                offset: 8192,
                len: 4096,
                crc: 0xdead_beef,
                rows: 16,
                digest: vec![9; 32],
            },
            Record::Gone {
                at: at("a", 3, 7, 16),
                reason: Reason::Policy,
                digest: vec![4; 32],
            },
            Record::Summary {
                at: at("a", 2, 0, 5),
                reason: Reason::Explicit,
                digest: vec![5; 32],
                counts: vec![3, 2],
                kv: vec![7; 64],
            },
            Record::Unpersist { phys: 99 },
            Record::Lost {
                phys: 98,
                reason: Reason::Integrity,
            },
            Record::Drop { key: key("a") },
        ]
    }

    #[test]
    fn records_round_trip_and_a_torn_tail_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("manifest");
        let mut bytes = frame(&records());
        std::fs::write(&path, &bytes).unwrap();
        let (back, valid) = read_file(&path).unwrap();
        assert_eq!((back, valid), (records(), bytes.len() as u64));
        // A torn write: half a record more.
        let full = bytes.len();
        bytes.extend_from_slice(&[40, 0, 0, 0, 1, 2, 3]);
        std::fs::write(&path, &bytes).unwrap();
        let (back, at) = read_file(&path).unwrap();
        assert_eq!((back.len(), at), (records().len(), full as u64));
        // A flipped byte inside the last record: replay stops before it.
        bytes.truncate(full);
        let last = bytes.len() - 3;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(read_file(&path).unwrap().0.len(), records().len() - 1);
    }

    #[test]
    fn a_file_without_this_versions_header_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("manifest");
        for first in [
            Record::Header { version: 1 },
            Record::Header { version: 2 },
            Record::Drop { key: key("a") },
        ] {
            let old_header = matches!(first, Record::Header { .. });
            let bytes = frame(&[first]);
            std::fs::write(&path, &bytes).unwrap();
            let err = read_file(&path).unwrap_err().to_string();
            assert!(err.contains("format"), "{err}");
            assert!(!old_header || err.contains("data directory moved aside"), "{err}");
        }
    }
}
