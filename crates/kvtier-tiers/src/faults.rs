//! A tier wrapper that injects device faults (ENOSPC, EIO) on command, for
//! testing that the layers above stay consistent when a disk misbehaves.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use crate::{AlignedBuf, Completion, ReadDone, Slot, Tier, TierError, TierKind, WriteDone};

/// What to break, switchable while the tier is in use.
#[derive(Debug, Default)]
pub struct Faults {
    /// Writes fail with ENOSPC once this many more bytes were written
    /// (`u64::MAX`: never).
    pub writes_left: AtomicU64,
    /// Every write fails with EIO.
    pub write_eio: AtomicBool,
    /// Every read fails with EIO.
    pub read_eio: AtomicBool,
    /// Every read first sleeps this many microseconds (a slow device).
    pub read_delay_us: AtomicU64,
}

impl Faults {
    /// Nothing broken (`writes_left` at `u64::MAX`; `Faults::default()` has 0, so every write
    /// fails), shared so a test can switch faults on later.
    pub fn none() -> Arc<Self> {
        Arc::new(Self {
            writes_left: AtomicU64::new(u64::MAX),
            ..Self::default()
        })
    }
}

/// Wraps a tier and fails its operations as its [`Faults`] say, passing everything else (and
/// every label) through to the inner tier.
#[derive(Debug)]
pub struct FaultyTier<T> {
    inner: T,
    faults: Arc<Faults>,
}

impl<T: Tier> FaultyTier<T> {
    /// Wraps `inner`, breaking what `faults` says whenever it says so.
    pub fn new(inner: T, faults: Arc<Faults>) -> Self {
        Self { inner, faults }
    }

    fn write_fault(&self, len: usize, offset: u64) -> Option<TierError> {
        if self.faults.write_eio.load(Relaxed) {
            return Some(fault("write", offset, libc::EIO));
        }
        let left = self.faults.writes_left.load(Relaxed);
        if left != u64::MAX {
            if left < len as u64 {
                return Some(fault("write", offset, libc::ENOSPC));
            }
            self.faults.writes_left.fetch_sub(len as u64, Relaxed);
        }
        None
    }

    fn read_fault(&self, offset: u64) -> Option<TierError> {
        self.slow_down();
        self.faults
            .read_eio
            .load(Relaxed)
            .then(|| fault("read", offset, libc::EIO))
    }

    fn slow_down(&self) {
        let delay = self.faults.read_delay_us.load(Relaxed);
        if delay > 0 {
            std::thread::sleep(std::time::Duration::from_micros(delay));
        }
    }
}

fn fault(op: &'static str, offset: u64, errno: i32) -> TierError {
    TierError::Io {
        op,
        offset,
        errno: Some(errno),
        message: std::io::Error::from_raw_os_error(errno).to_string(),
    }
}

impl<T: Tier> Tier for FaultyTier<T> {
    fn kind(&self) -> TierKind {
        self.inner.kind()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn emulated(&self) -> bool {
        self.inner.emulated()
    }
    fn allocator(&self) -> &Arc<crate::ExtentAllocator> {
        self.inner.allocator()
    }
    fn write(&self, slot: &mut Slot, offset: u64, src: &[u8]) -> Result<(), TierError> {
        match self.write_fault(src.len(), slot.offset() + offset) {
            Some(e) => Err(e),
            None => self.inner.write(slot, offset, src),
        }
    }
    fn read(&self, slot: &Slot, offset: u64, dst: &mut [u8]) -> Result<(), TierError> {
        match self.read_fault(slot.offset() + offset) {
            Some(e) => Err(e),
            None => self.inner.read(slot, offset, dst),
        }
    }
    fn read_many(&self, reads: Vec<(Arc<Slot>, AlignedBuf)>) -> Vec<Completion<ReadDone>> {
        self.slow_down();
        if self.faults.read_eio.load(Relaxed) {
            return reads
                .into_iter()
                .map(|(slot, buf)| {
                    Completion::ready(ReadDone {
                        buf,
                        result: Err(fault("read", slot.offset(), libc::EIO)),
                    })
                })
                .collect();
        }
        self.inner.read_many(reads)
    }
    fn write_many(&self, writes: Vec<(Slot, AlignedBuf)>) -> Vec<Completion<WriteDone>> {
        let mut out = Vec::with_capacity(writes.len());
        let mut pass = Vec::new();
        let mut failed = Vec::new();
        for (slot, buf) in writes {
            match self.write_fault(buf.len(), slot.offset()) {
                Some(e) => failed.push(Completion::ready(WriteDone {
                    slot,
                    buf,
                    result: Err(e),
                })),
                None => pass.push((slot, buf)),
            }
        }
        out.extend(self.inner.write_many(pass));
        out.extend(failed);
        out
    }
    fn sync(&self) -> Result<(), TierError> {
        if self.faults.write_eio.load(Relaxed) {
            return Err(fault("fdatasync", 0, libc::EIO));
        }
        self.inner.sync()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ArenaTier;

    crate::tier_conformance_tests!(faulty_without_faults, |capacity| {
        FaultyTier::new(ArenaTier::host(capacity).unwrap(), Faults::none())
    });

    #[test]
    fn faults_fire_when_asked() {
        let faults = Faults::none();
        let tier = FaultyTier::new(ArenaTier::host(1 << 16).unwrap(), Arc::clone(&faults));
        let mut slot = tier.allocate(100).unwrap();
        faults.writes_left.store(150, Relaxed);
        tier.write(&mut slot, 0, &[1; 100]).unwrap();
        assert!(tier.write(&mut slot, 0, &[1; 100]).unwrap_err().is_no_space());
        faults.read_eio.store(true, Relaxed);
        let e = tier.read(&slot, 0, &mut [0; 10]).unwrap_err();
        assert!(
            matches!(
                e,
                TierError::Io {
                    errno: Some(libc::EIO),
                    ..
                }
            ),
            "{e}"
        );
    }
}
