//! Protobuf's wire format, just enough to take a message apart into fields
//! and put it back, so that mutations change values field by field (a
//! varint to an edge value, a length off by one, a field repeated or
//! dropped, a nested message mutated in turn) instead of only flipping bits.

use crate::rng::Rng;

#[derive(Debug, Clone)]
pub(crate) enum Value {
    Varint(u64),
    Fixed64(u64),
    Bytes(Vec<u8>),
    Fixed32(u32),
}

pub(crate) type Fields = Vec<(u32, Value)>;

fn varint(buf: &[u8], at: &mut usize) -> Option<u64> {
    let mut out = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *buf.get(*at)?;
        *at += 1;
        out |= u64::from(b & 0x7f) << shift;
        if b < 0x80 {
            return Some(out);
        }
    }
    None
}

/// The fields of `buf`, or `None` if it is not a well-formed message.
pub(crate) fn parse(buf: &[u8]) -> Option<Fields> {
    let mut fields = Vec::new();
    let mut at = 0;
    while at < buf.len() {
        let key = varint(buf, &mut at)?;
        let (number, kind) = (u32::try_from(key >> 3).ok()?, key & 7);
        let value = match kind {
            0 => Value::Varint(varint(buf, &mut at)?),
            1 => {
                let b = buf.get(at..at + 8)?;
                at += 8;
                Value::Fixed64(u64::from_le_bytes(b.try_into().ok()?))
            }
            2 => {
                let len = usize::try_from(varint(buf, &mut at)?).ok()?;
                let b = buf.get(at..at.checked_add(len)?)?;
                at += len;
                Value::Bytes(b.to_vec())
            }
            5 => {
                let b = buf.get(at..at + 4)?;
                at += 4;
                Value::Fixed32(u32::from_le_bytes(b.try_into().ok()?))
            }
            _ => return None,
        };
        if number == 0 {
            return None;
        }
        fields.push((number, value));
    }
    Some(fields)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(crate) fn encode(fields: &Fields) -> Vec<u8> {
    let mut out = Vec::new();
    for (number, value) in fields {
        let kind = match value {
            Value::Varint(_) => 0,
            Value::Fixed64(_) => 1,
            Value::Bytes(_) => 2,
            Value::Fixed32(_) => 5,
        };
        put_varint(&mut out, (u64::from(*number) << 3) | kind);
        match value {
            Value::Varint(v) => put_varint(&mut out, *v),
            Value::Fixed64(v) => out.extend(v.to_le_bytes()),
            Value::Bytes(b) => {
                put_varint(&mut out, b.len() as u64);
                out.extend(b);
            }
            Value::Fixed32(v) => out.extend(v.to_le_bytes()),
        }
    }
    out
}

const EDGES: [u64; 24] = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    15,
    16,
    17,
    63,
    64,
    255,
    1023,
    1024,
    1025,
    65_535,
    65_536,
    (1 << 31) - 1,
    1 << 31,
    u32::MAX as u64,
    1 << 32,
    i64::MAX as u64,
    u64::MAX,
];

const FLOATS: [f32; 12] = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    f32::MAX,
    f32::MIN,
    f32::MIN_POSITIVE,
    1e-45,
    65504.0,
];

/// Bytes that read as f32 values at the edges (queries, weights, keys).
fn float_bytes(rng: &mut Rng, floats: usize) -> Vec<u8> {
    (0..floats).flat_map(|_| rng.pick(&FLOATS).to_le_bytes()).collect()
}

/// One mutation of one field of `fields` (a nested message, with some
/// chance, mutated in turn); `keep` names fields left alone.
pub(crate) fn mutate(rng: &mut Rng, fields: &mut Fields, keep: &[u32], depth: u32) {
    let editable: Vec<usize> = (0..fields.len()).filter(|&i| !keep.contains(&fields[i].0)).collect();
    match rng.below(8) {
        // Add a field: a known number with an unexpected type, or an unknown one.
        0 => {
            let number = if rng.chance(50) {
                rng.below(16) as u32 + 1
            } else {
                rng.below(1 << 12) as u32 + 1
            };
            if keep.contains(&number) {
                return;
            }
            let value = match rng.below(4) {
                0 => Value::Varint(*rng.pick(&EDGES)),
                1 => Value::Fixed64(rng.next()),
                2 => {
                    let n = rng.below(64) as usize;
                    Value::Bytes(rng.bytes(n))
                }
                _ => Value::Fixed32(rng.pick(&FLOATS).to_bits()),
            };
            fields.push((number, value));
        }
        // Drop or repeat a field.
        1 if !editable.is_empty() => {
            let i = editable[rng.below(editable.len() as u64) as usize];
            if rng.chance(50) {
                fields.remove(i);
            } else {
                let copy = fields[i].clone();
                fields.push(copy);
            }
        }
        // Change a value.
        _ if !editable.is_empty() => {
            let i = editable[rng.below(editable.len() as u64) as usize];
            let value = &mut fields[i].1;
            match value {
                Value::Varint(v) => {
                    *v = match rng.below(3) {
                        0 => *rng.pick(&EDGES),
                        1 => v.wrapping_add(1),
                        _ => v.wrapping_sub(1),
                    }
                }
                Value::Fixed32(v) => *v = rng.pick(&FLOATS).to_bits(),
                Value::Fixed64(v) => *v = rng.next(),
                Value::Bytes(b) => mutate_bytes(rng, b, depth),
            }
        }
        _ => {}
    }
}

fn mutate_bytes(rng: &mut Rng, b: &mut Vec<u8>, depth: u32) {
    if depth < 3
        && rng.chance(50)
        && let Some(mut nested) = parse(b).filter(|f| !f.is_empty())
    {
        mutate(rng, &mut nested, &[], depth + 1);
        *b = encode(&nested);
        return;
    }
    match rng.below(6) {
        0 => b.truncate(b.len().saturating_sub(1 + rng.below(4) as usize)),
        1 => b.push(rng.next() as u8),
        2 => b.clear(),
        3 => {
            let floats = b.len() / 4 + rng.below(2) as usize;
            *b = float_bytes(rng, floats);
        }
        4 if !b.is_empty() => {
            let i = rng.below(b.len() as u64) as usize;
            b[i] ^= 1 << rng.below(8);
        }
        _ => {
            let copy = b.clone();
            b.extend(copy);
        }
    }
}
