//! The swap-in kernel, compiled at run time with NVRTC: one block per page
//! copies it from mapped pinned host memory into its device slot (16 bytes
//! per thread and step) and writes the page's device address into the
//! step's page table, which a sparse-attention kernel reads next.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use crate::{CudaError, Gpu};

const SOURCE: &str = r#"
extern "C" __global__ void kvtier_gather(
    const unsigned long long* src, const unsigned long long* dst, const unsigned long long* len,
    unsigned long long* table, unsigned int n)
{
    unsigned int p = blockIdx.x;
    if (p >= n) return;
    const unsigned char* s = (const unsigned char*)src[p];
    unsigned char* d = (unsigned char*)dst[p];
    unsigned long long bytes = len[p];
    unsigned long long vec = bytes / 16;
    const uint4* s4 = (const uint4*)s;
    uint4* d4 = (uint4*)d;
    for (unsigned long long i = threadIdx.x; i < vec; i += blockDim.x) d4[i] = s4[i];
    for (unsigned long long i = vec * 16 + threadIdx.x; i < bytes; i += blockDim.x) d[i] = s[i];
    if (threadIdx.x == 0) table[p] = dst[p];
}
"#;

pub(crate) fn compile(gpu: &Arc<Gpu>) -> Result<CudaFunction, CudaError> {
    // SAFETY: only tries to open the NVRTC library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::Compile("NVRTC library not found".into()));
    }
    let ptx = cudarc::nvrtc::compile_ptx(SOURCE).map_err(|e| CudaError::Compile(e.to_string()))?;
    let module = gpu.ctx.load_module(ptx)?;
    Ok(module.load_function("kvtier_gather")?)
}

/// Launches the gather of `n` pages; the argument arrays are device
/// addresses of `n` u64s each (sources, destinations, lengths, table).
///
/// # Safety
/// Every source must be readable and every destination writable device
/// memory of its length, the destinations must not overlap, and all of it
/// must stay valid until `stream` is synchronised.
pub(crate) unsafe fn launch(
    stream: &Arc<CudaStream>,
    func: &CudaFunction,
    [src, dst, len, table]: [u64; 4],
    n: u32,
) -> Result<(), CudaError> {
    let config = LaunchConfig {
        grid_dim: (n, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = stream.launch_builder(func);
    args.arg(&src).arg(&dst).arg(&len).arg(&table).arg(&n);
    // SAFETY: forwarded from this function's contract; the kernel reads
    // `n` entries of each array and the bytes they describe.
    unsafe { args.launch(config) }?;
    Ok(())
}
