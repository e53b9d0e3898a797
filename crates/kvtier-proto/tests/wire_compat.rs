//! Wire compatibility within `kvtier.v1`: every message field (name,
//! number, type, label), enum value and RPC ever released stays as it was;
//! additions are allowed. `proto/kvtier/v1/wire.txt` lists what has been
//! released; the test fails when the proto lost or changed any line of it,
//! and when the proto has lines it does not list yet
//! (`KVTIER_BLESS=1 cargo test -p kvtier-proto --test wire_compat` adds
//! them, and never removes one).

use std::collections::BTreeSet;
use std::path::Path;

use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{DescriptorProto, EnumDescriptorProto, FileDescriptorSet};

fn message_lines(prefix: &str, message: &DescriptorProto, out: &mut BTreeSet<String>) {
    let name = format!("{prefix}.{}", message.name());
    for field in &message.field {
        let kind = match field.r#type() {
            Type::Message | Type::Enum => field.type_name().to_owned(),
            other => other.as_str_name().trim_start_matches("TYPE_").to_lowercase(),
        };
        let label = match field.label() {
            Label::Repeated => "repeated ",
            _ if field.proto3_optional() => "optional ",
            _ => "",
        };
        let oneof = field
            .oneof_index
            .filter(|_| !field.proto3_optional())
            .map_or(String::new(), |i| {
                format!(" (oneof {})", message.oneof_decl[i as usize].name())
            });
        out.insert(format!(
            "field {name}.{} = {}: {label}{kind}{oneof}",
            field.name(),
            field.number()
        ));
    }
    for nested in &message.nested_type {
        message_lines(&name, nested, out);
    }
    for e in &message.enum_type {
        enum_lines(&name, e, out);
    }
}

fn enum_lines(prefix: &str, e: &EnumDescriptorProto, out: &mut BTreeSet<String>) {
    for value in &e.value {
        out.insert(format!(
            "enum {prefix}.{}.{} = {}",
            e.name(),
            value.name(),
            value.number()
        ));
    }
}

fn current() -> BTreeSet<String> {
    let set = FileDescriptorSet::decode(kvtier_proto::FILE_DESCRIPTOR_SET).unwrap();
    let mut out = BTreeSet::new();
    for file in set.file.iter().filter(|f| f.package() == "kvtier.v1") {
        let package = format!(".{}", file.package());
        for message in &file.message_type {
            message_lines(&package, message, &mut out);
        }
        for e in &file.enum_type {
            enum_lines(&package, e, &mut out);
        }
        for service in &file.service {
            for m in &service.method {
                let stream = |s: bool| if s { "stream " } else { "" };
                out.insert(format!(
                    "rpc {package}.{}.{}({}{}) returns ({}{})",
                    service.name(),
                    m.name(),
                    stream(m.client_streaming()),
                    m.input_type(),
                    stream(m.server_streaming()),
                    m.output_type()
                ));
            }
        }
    }
    out
}

/// The lines of `proto/kvtier/v1/wire.txt` as every commit of this
/// checkout's history had them; empty outside a git checkout.
fn committed_lines(root: &Path) -> BTreeSet<String> {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let mut lines = BTreeSet::new();
    let commits = git(&["log", "--format=%H", "--", "proto/kvtier/v1/wire.txt"]).unwrap_or_default();
    for commit in commits.lines() {
        let text = git(&["show", &format!("{commit}:proto/kvtier/v1/wire.txt")]).unwrap_or_default();
        lines.extend(
            text.lines()
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(str::to_owned),
        );
    }
    lines
}

#[test]
fn no_line_ever_committed_to_wire_txt_is_gone_from_it() {
    // wire.txt is edited by the same hands as the proto: a field removed
    // from both would pass the test below. Its history cannot be edited.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let text = std::fs::read_to_string(root.join("proto/kvtier/v1/wire.txt")).unwrap();
    let now: BTreeSet<&str> = text.lines().collect();
    let gone: Vec<_> = committed_lines(&root)
        .into_iter()
        .filter(|l| !now.contains(l.as_str()))
        .collect();
    assert!(
        gone.is_empty(),
        "lines once released in wire.txt are gone from it: {gone:#?}"
    );
}

#[test]
fn released_fields_enum_values_and_rpcs_never_change() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto/kvtier/v1/wire.txt");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let released: BTreeSet<String> = text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    let now = current();
    let lost: Vec<_> = released.difference(&now).collect();
    assert!(
        lost.is_empty(),
        "kvtier.v1 broke wire compatibility: these released lines are gone or changed (a field's number, \
         name, type or label; an enum value; an RPC's types): {lost:#?}. Add new fields instead; a break \
         needs kvtier.v2"
    );
    let added: Vec<_> = now.difference(&released).collect();
    if added.is_empty() {
        return;
    }
    if std::env::var_os("KVTIER_BLESS").is_some() {
        let header: String = text
            .lines()
            .take_while(|l| l.starts_with('#'))
            .map(|l| format!("{l}\n"))
            .collect();
        let body: String = now.union(&released).map(|l| format!("{l}\n")).collect();
        std::fs::write(&path, header + &body).unwrap();
        return;
    }
    panic!(
        "kvtier.v1 has lines proto/kvtier/v1/wire.txt does not list yet: {added:#?}; once they are final, \
         KVTIER_BLESS=1 cargo test -p kvtier-proto --test wire_compat records them"
    );
}
