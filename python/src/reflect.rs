//! Python values to `kvtier.v1` messages and back, driven by the proto's
//! descriptor: a request is a dict keyed by field names (nested messages
//! are dicts, repeated fields lists, enums their value's name or number,
//! `bytes` fields `bytes`); a response is a dict with every field of its
//! message (unset messages and optional scalars are `None`, enums the
//! lower-case name without the enum's prefix: `"hot"`, `"nvme"`).
//! Generic on purpose: every RPC and every field the proto gains reaches
//! Python without code here.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::thread::LocalKey;

use bytes::Bytes;
use prost_reflect::{DynamicMessage, EnumDescriptor, FieldDescriptor, Kind, MessageDescriptor, ReflectMessage, Value};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

/// `obj` (a dict) as a message of type `desc`; errors name the field's
/// path (`shard.world`).
pub(crate) fn to_message(obj: &Bound<'_, PyAny>, desc: &MessageDescriptor, path: &str) -> PyResult<DynamicMessage> {
    let dict = obj.cast::<PyDict>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{}: expected a dict for {}",
            name_or(path, "request"),
            desc.name()
        ))
    })?;
    let mut msg = DynamicMessage::new(desc.clone());
    for (key, value) in dict.iter() {
        let key: String = key
            .extract()
            .map_err(|_| PyTypeError::new_err(format!("{}: field names are strings", name_or(path, "request"))))?;
        let field_path = join(path, &key);
        let field = desc
            .get_field_by_name(&key)
            .ok_or_else(|| PyValueError::new_err(format!("{field_path}: {} has no such field", desc.full_name())))?;
        if value.is_none() {
            continue;
        }
        let value = if field.is_list() {
            let items: Vec<Bound<'_, PyAny>> = value
                .try_iter()
                .map_err(|_| PyTypeError::new_err(format!("{field_path}: expected a list")))?
                .collect::<PyResult<_>>()?;
            let values = items
                .iter()
                .enumerate()
                .map(|(i, item)| to_value(item, &field, &format!("{field_path}[{i}]")))
                .collect::<PyResult<_>>()?;
            Value::List(values)
        } else if field.is_map() {
            return Err(PyTypeError::new_err(format!(
                "{field_path}: map fields are not supported"
            )));
        } else {
            to_value(&value, &field, &field_path)?
        };
        msg.set_field(&field, value);
    }
    Ok(msg)
}

/// A value of field `path` that could not be converted, as the error that
/// names the field.
pub(crate) fn wrong_value(path: &str) -> impl Fn(PyErr) -> PyErr + '_ {
    move |e| PyTypeError::new_err(format!("{path}: {e}"))
}

fn to_value(obj: &Bound<'_, PyAny>, field: &FieldDescriptor, path: &str) -> PyResult<Value> {
    let wrong = wrong_value(path);
    Ok(match field.kind() {
        Kind::Double => Value::F64(obj.extract().map_err(wrong)?),
        Kind::Float => Value::F32(obj.extract().map_err(wrong)?),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => Value::I32(obj.extract().map_err(wrong)?),
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => Value::I64(obj.extract().map_err(wrong)?),
        Kind::Uint32 | Kind::Fixed32 => Value::U32(obj.extract().map_err(wrong)?),
        Kind::Uint64 | Kind::Fixed64 => Value::U64(obj.extract().map_err(wrong)?),
        Kind::Bool => Value::Bool(obj.extract().map_err(wrong)?),
        Kind::String => Value::String(obj.extract().map_err(wrong)?),
        Kind::Bytes => {
            let bytes = obj
                .cast::<PyBytes>()
                .map_err(|_| PyTypeError::new_err(format!("{path}: expected bytes")))?;
            Value::Bytes(Bytes::copy_from_slice(bytes.as_bytes()))
        }
        Kind::Enum(e) => Value::EnumNumber(enum_number(obj, &e, path)?),
        Kind::Message(m) => Value::Message(to_message(obj, &m, path)?),
    })
}

/// An enum value from its number, full name (`PAGE_STATE_HOT`) or short
/// name (`hot`, any case).
fn enum_number(obj: &Bound<'_, PyAny>, desc: &EnumDescriptor, path: &str) -> PyResult<i32> {
    if obj.is_instance_of::<PyString>() {
        let name = obj.extract::<String>()?.to_ascii_uppercase();
        let names = enum_names(desc);
        return desc
            .get_value_by_name(&name)
            .or_else(|| desc.get_value_by_name(&format!("{}{name}", names.prefix)))
            .map(|v| v.number())
            .ok_or_else(|| {
                let known: Vec<&str> = desc
                    .values()
                    .skip(1)
                    .filter_map(|v| names.short.get(&v.number()).map(String::as_str))
                    .collect();
                PyValueError::new_err(format!("{path}: {name:?} is not one of {}", known.join(", ")))
            });
    }
    let number: i32 = obj
        .extract()
        .map_err(|_| PyTypeError::new_err(format!("{path}: expected a {} name or number", desc.name())))?;
    desc.get_value(number)
        .map(|v| v.number())
        .ok_or_else(|| PyValueError::new_err(format!("{path}: {number} is not a {} value", desc.name())))
}

/// An enum's value names as Python sees them.
struct EnumNames {
    /// What every value name starts with (`PAGE_STATE_`).
    prefix: String,
    /// Each value's name without it, lower-case (`"hot"`), by number.
    short: HashMap<i32, String>,
}

/// `desc`'s names, worked out once per enum and thread: a fetch's reply
/// converts three enums per page, and working them out each time (every
/// value name copied and compared) was most of the conversion.
fn enum_names(desc: &EnumDescriptor) -> Rc<EnumNames> {
    thread_local! {
        static NAMES: Cache<EnumNames> = RefCell::default();
    }
    once_per_thread(&NAMES, desc.full_name(), || {
        let prefix = enum_prefix(desc);
        let short = desc
            .values()
            .map(|v| (v.number(), short_name(&prefix, v.name())))
            .collect();
        EnumNames { prefix, short }
    })
}

/// What a descriptor's name maps to, worked out once per thread.
type Cache<T> = RefCell<HashMap<String, Rc<T>>>;

/// `name`'s entry in `cache`, made by `make` the first time it is asked for.
fn once_per_thread<T>(cache: &'static LocalKey<Cache<T>>, name: &str, make: impl FnOnce() -> T) -> Rc<T> {
    cache.with(|known| {
        if let Some(made) = known.borrow().get(name) {
            return Rc::clone(made);
        }
        let made = Rc::new(make());
        known.borrow_mut().insert(name.to_owned(), Rc::clone(&made));
        made
    })
}

/// What every value name of the enum starts with, up to its last `_`
/// (`PAGE_STATE_` for `PAGE_STATE_HOT`, `PAGE_STATE_COLD`, …).
fn enum_prefix(desc: &EnumDescriptor) -> String {
    let names: Vec<String> = desc.values().map(|v| v.name().to_owned()).collect();
    let first = names.first().cloned().unwrap_or_default();
    let mut common = first.len();
    for name in &names[1..] {
        common = common.min(first.bytes().zip(name.bytes()).take_while(|(a, b)| a == b).count());
    }
    match first[..common].rfind('_') {
        Some(end) => first[..=end].to_owned(),
        None => String::new(),
    }
}

fn short_name(prefix: &str, name: &str) -> String {
    name.strip_prefix(prefix).unwrap_or(name).to_ascii_lowercase()
}

/// `msg` as a dict with every field of its message.
pub(crate) fn to_dict<'py>(py: Python<'py>, msg: &DynamicMessage) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    let desc = msg.descriptor();
    let keys = field_keys(py, &desc);
    for (field, key) in desc.fields().zip(keys.iter()) {
        let value = if field.supports_presence() && !msg.has_field(&field) {
            py.None().into_bound(py)
        } else {
            to_py(py, &msg.get_field(&field), &field.kind())?
        };
        dict.set_item(key.bind(py), value)?;
    }
    Ok(dict)
}

/// The dict keys of `desc`'s fields, in field order, made once per message
/// type and thread (interned, their hashes computed once): a new string per
/// key per page cost about 0.5 us a page of a fetch's reply.
fn field_keys(py: Python<'_>, desc: &MessageDescriptor) -> Rc<Vec<Py<PyString>>> {
    thread_local! {
        static KEYS: Cache<Vec<Py<PyString>>> = RefCell::default();
    }
    once_per_thread(&KEYS, desc.full_name(), || {
        desc.fields().map(|f| PyString::intern(py, f.name()).unbind()).collect()
    })
}

fn to_py<'py>(py: Python<'py>, value: &Value, kind: &Kind) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Value::I32(n) => n.into_pyobject(py)?.into_any(),
        Value::I64(n) => n.into_pyobject(py)?.into_any(),
        Value::U32(n) => n.into_pyobject(py)?.into_any(),
        Value::U64(n) => n.into_pyobject(py)?.into_any(),
        Value::F32(x) => x.into_pyobject(py)?.into_any(),
        Value::F64(x) => x.into_pyobject(py)?.into_any(),
        Value::String(s) => PyString::new(py, s).into_any(),
        Value::Bytes(b) => PyBytes::new(py, b).into_any(),
        Value::EnumNumber(n) => match kind {
            Kind::Enum(e) => match enum_names(e).short.get(n) {
                Some(name) => PyString::new(py, name).into_any(),
                None => n.into_pyobject(py)?.into_any(),
            },
            _ => n.into_pyobject(py)?.into_any(),
        },
        Value::Message(m) => to_dict(py, m)?.into_any(),
        Value::List(items) => {
            let items = items.iter().map(|v| to_py(py, v, kind)).collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any()
        }
        Value::Map(_) => return Err(PyTypeError::new_err("map fields are not supported")),
    })
}

fn join(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

fn name_or<'a>(path: &'a str, otherwise: &'a str) -> &'a str {
    if path.is_empty() { otherwise } else { path }
}
