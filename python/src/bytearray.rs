//! Python `bytearray`s filled from Rust without zeroing them first: what
//! a decode step's answer is copied into once (its pages, its attention
//! rows), and read by numpy or torch as it is.

use std::mem::MaybeUninit;

use pyo3::exceptions::PyRuntimeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;

/// A new `bytearray` of `len` bytes, every one written by `fill` (which
/// must, when it returns `Ok`): not zeroed first, as `PyByteArray::new_with`
/// would, since each is copied over anyway (a step's pages: hundreds of
/// kilobytes).
pub(crate) fn filled<'py>(
    py: Python<'py>,
    len: usize,
    fill: impl FnOnce(&mut [MaybeUninit<u8>]) -> PyResult<()>,
) -> PyResult<Bound<'py, PyByteArray>> {
    let size = ffi::Py_ssize_t::try_from(len).map_err(|_| PyRuntimeError::new_err("a selection larger than memory"))?;
    // SAFETY: a null source makes a bytearray of `len` bytes whose contents
    // are not set; it is a new reference, owned here (or null with an
    // exception set, which `from_owned_ptr_or_err` takes).
    let array =
        unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyByteArray_FromStringAndSize(std::ptr::null(), size))? }
            .cast_into::<PyByteArray>()?;
    // SAFETY: the bytearray's buffer holds `len` bytes and lives as long as
    // `array`, which no other code has seen yet; `MaybeUninit` claims
    // nothing of its contents. On an error the array is dropped unread.
    let room = unsafe {
        std::slice::from_raw_parts_mut(ffi::PyByteArray_AsString(array.as_ptr()).cast::<MaybeUninit<u8>>(), len)
    };
    fill(room)?;
    Ok(array)
}
