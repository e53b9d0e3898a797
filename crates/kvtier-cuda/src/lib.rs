#![warn(missing_docs)]
//! The device tier on a real GPU, through cudarc with dynamic loading: this
//! crate builds and loads on a machine without CUDA, [`probe`] says at run
//! time whether a device is usable, and callers fall back to the emulated
//! device (`kvtier_tiers::ArenaTier::emulated_device`) when it is not.
//!
//! With cudarc, a missing driver library makes the first call panic instead
//! of failing, so every entry point goes through [`probe`] first.

mod device;
mod gather;
mod pinned;

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

pub use device::{CudaDeviceTier, SwapPath};
pub use pinned::PinnedHostTier;

/// What the machine offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// No CUDA driver library could be loaded.
    NoDriver,
    /// The driver loaded but reports no device.
    NoDevice,
    /// The driver or device failed.
    Failed(String),
    /// Device 0 can be used.
    Ready {
        /// The device's name as the driver reports it.
        name: String,
        /// Its total memory in bytes.
        memory_bytes: u64,
        /// Its compute capability as (major, minor): (9, 0) for an H100.
        compute_capability: (i32, i32),
    },
}

impl fmt::Display for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Probe::NoDriver => f.write_str("no CUDA driver library (libcuda) on this machine"),
            Probe::NoDevice => f.write_str("the CUDA driver reports no device"),
            Probe::Failed(e) => write!(f, "CUDA failed: {e}"),
            Probe::Ready {
                name,
                memory_bytes,
                compute_capability: (major, minor),
            } => {
                write!(
                    f,
                    "{name}, {} MiB, compute capability {major}.{minor}",
                    memory_bytes >> 20
                )
            }
        }
    }
}

/// Checks for a usable CUDA device 0 without ever panicking.
pub fn probe() -> Probe {
    // SAFETY: only tries to open the driver library; no CUDA call is made.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Probe::NoDriver;
    }
    match CudaContext::device_count() {
        Ok(0) => return Probe::NoDevice,
        Ok(_) => {}
        Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE => return Probe::NoDevice,
        Err(e) => return Probe::Failed(e.to_string()),
    }
    let ctx = match CudaContext::new(0) {
        Ok(ctx) => ctx,
        Err(e) => return Probe::Failed(e.to_string()),
    };
    let details = ctx
        .name()
        .and_then(|name| Ok((name, ctx.total_mem()?, ctx.compute_capability()?)));
    match details {
        Ok((name, memory, cc)) => Probe::Ready {
            name,
            memory_bytes: memory as u64,
            compute_capability: cc,
        },
        Err(e) => Probe::Failed(e.to_string()),
    }
}

/// Why a CUDA tier could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// [`probe`] found no usable device; the value says why.
    #[error("no usable CUDA device: {0}")]
    Unavailable(Probe),
    /// A CUDA driver call failed.
    #[error("CUDA: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// NVRTC is missing or could not compile the gather kernel. (A pinned host allocation that
    /// comes back null is reported as this too.)
    #[error("NVRTC could not compile the swap-in kernel: {0}")]
    Compile(String),
}

/// Device 0's context and the stream every copy of this process uses.
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
}

impl Gpu {
    /// Opens device 0 if [`probe`] finds it ready.
    pub fn open() -> Result<Arc<Self>, CudaError> {
        match probe() {
            Probe::Ready { name, .. } => {
                let ctx = CudaContext::new(0)?;
                let stream = ctx.new_stream()?;
                Ok(Arc::new(Self { ctx, stream, name }))
            }
            other => Err(CudaError::Unavailable(other)),
        }
    }

    /// The device's name as the driver reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn bind(&self) -> Result<(), cudarc::driver::DriverError> {
        self.ctx.bind_to_thread()
    }
}

/// Why GPU tests are skipped here, or `None` when a device is ready. With
/// `KVTIER_REQUIRE_GPU` set, a missing device fails instead of skipping.
pub fn gpu_missing() -> Option<String> {
    match probe() {
        Probe::Ready { .. } => None,
        other => {
            assert!(
                std::env::var_os("KVTIER_REQUIRE_GPU").is_none(),
                "a GPU is required here: {other}"
            );
            Some(format!("no GPU: {other}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probing_never_panics_and_says_what_it_found() {
        let p = probe();
        println!("CUDA probe: {p}");
        assert!(!p.to_string().is_empty());
        match gpu_missing() {
            Some(reason) => println!("skipped GPU checks: {reason}"),
            None => assert!(Gpu::open().is_ok()),
        }
    }
}
