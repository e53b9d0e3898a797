//! A reader for the uncompressed `.npz` files of a realkv dataset: a zip of
//! stored (uncompressed) `.npy` arrays, possibly with zip64 sizes, as
//! `numpy.savez` writes them. Compressed archives are refused with a clear
//! error rather than misread.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, bail, ensure};

/// One array: little-endian element bytes in C order.
#[derive(Debug, Clone)]
pub(crate) struct Array {
    pub(crate) descr: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) data: Vec<u8>,
}

impl Array {
    /// The elements as f32 (`<f2` and `<f4` only).
    pub(crate) fn to_f32(&self) -> anyhow::Result<Vec<f32>> {
        match self.descr.as_str() {
            "<f2" => Ok(self
                .data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect()),
            "<f4" => Ok(self
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()),
            other => bail!("expected a float16 or float32 array, found dtype {other:?}"),
        }
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// All arrays of an `.npz`, by name without the `.npy` suffix.
pub(crate) fn read_npz(path: &Path) -> anyhow::Result<HashMap<String, Array>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    parse_npz(&bytes).with_context(|| format!("parsing {}", path.display()))
}

fn parse_npz(b: &[u8]) -> anyhow::Result<HashMap<String, Array>> {
    const LOCAL: u32 = 0x0403_4b50;
    let mut arrays = HashMap::new();
    let mut at = 0;
    while at + 30 <= b.len() && u32_at(b, at) == LOCAL {
        let flags = u16_at(b, at + 6);
        let method = u16_at(b, at + 8);
        let mut size = u64::from(u32_at(b, at + 18));
        let name_len = usize::from(u16_at(b, at + 26));
        let extra_len = usize::from(u16_at(b, at + 28));
        let name_at = at + 30;
        ensure!(name_at + name_len + extra_len <= b.len(), "truncated zip header");
        let name = std::str::from_utf8(&b[name_at..name_at + name_len])?.to_owned();
        ensure!(
            method == 0,
            "{name} is compressed (method {method}); use numpy.savez, not savez_compressed"
        );
        ensure!(
            flags & 0x08 == 0,
            "{name} uses a data descriptor, which this reader does not support"
        );
        if size == u64::from(u32::MAX) {
            // zip64: the real sizes are in the extra field (id 0x0001).
            let extra = &b[name_at + name_len..name_at + name_len + extra_len];
            let mut e = 0;
            let mut found = None;
            while e + 4 <= extra.len() {
                let (id, len) = (u16_at(extra, e), usize::from(u16_at(extra, e + 2)));
                if id == 1 && len >= 16 {
                    found = Some(u64_at(extra, e + 4)); // uncompressed size first
                }
                e += 4 + len;
            }
            size = found.with_context(|| format!("{name}: zip64 size missing"))?;
        }
        let data_at = name_at + name_len + extra_len;
        let end = data_at + usize::try_from(size)?;
        ensure!(end <= b.len(), "{name}: truncated data");
        let key = name.strip_suffix(".npy").unwrap_or(&name).to_owned();
        arrays.insert(
            key,
            parse_npy(&b[data_at..end]).with_context(|| format!("array {name}"))?,
        );
        at = end;
    }
    ensure!(!arrays.is_empty(), "no arrays found");
    Ok(arrays)
}

fn parse_npy(b: &[u8]) -> anyhow::Result<Array> {
    ensure!(b.len() >= 10 && &b[..6] == b"\x93NUMPY", "not an .npy array");
    let (header_len, header_at) = match b[6] {
        1 => (usize::from(u16_at(b, 8)), 10),
        2 | 3 => (u32_at(b, 8) as usize, 12),
        v => bail!("unsupported .npy version {v}"),
    };
    let header = std::str::from_utf8(&b[header_at..header_at + header_len])?;
    let field = |key: &str| -> anyhow::Result<&str> {
        let start = header
            .find(&format!("'{key}':"))
            .with_context(|| format!("no {key} in header"))?
            + key.len()
            + 3;
        Ok(header[start..].trim_start())
    };
    let descr = field("descr")?;
    let descr = descr.trim_start_matches('\'');
    let descr = descr[..descr.find('\'').context("descr")?].to_owned();
    ensure!(
        field("fortran_order")?.starts_with("False"),
        "Fortran-ordered arrays are not supported"
    );
    let shape = field("shape")?;
    let shape = &shape[1..shape.find(')').context("shape")?];
    let shape: Vec<usize> = shape
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let data = b[header_at + header_len..].to_vec();
    let size: usize = match descr.as_str() {
        "<f2" => 2,
        "<f4" | "<i4" => 4,
        "<f8" | "<i8" => 8,
        other => bail!("unsupported dtype {other}"),
    };
    ensure!(
        data.len() == shape.iter().product::<usize>() * size,
        "data length does not match shape {shape:?}"
    );
    Ok(Array { descr, shape, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(kvtier_no_realkv, ignore = "no realkv dataset: data/realkv/make.sh builds it")]
    fn reads_the_realkv_arrays() {
        let Some(dir) = crate::eval::tests::dataset() else {
            return;
        };
        let path = dir.join("layer04.npz");
        let arrays = read_npz(&path).unwrap();
        assert_eq!(arrays["q"].shape, [9, 2048, 64]);
        assert_eq!(arrays["k"].descr, "<f2");
        assert_eq!(arrays["positions"].shape, [2048]);
        let positions = &arrays["positions"].data;
        assert_eq!(i32::from_le_bytes(positions[4 * 7..4 * 8].try_into().unwrap()), 7);
        assert!(arrays["ref_out"].to_f32().unwrap().iter().all(|x| x.is_finite()));
    }

    #[test]
    fn compressed_archives_are_refused() {
        let mut fake = vec![0u8; 64];
        fake[..4].copy_from_slice(&0x0403_4b50u32.to_le_bytes());
        fake[8] = 8; // deflate
        fake[26] = 1;
        fake[30] = b'q';
        let err = parse_npz(&fake).unwrap_err().to_string();
        assert!(err.contains("compressed"), "{err}");
    }
}
