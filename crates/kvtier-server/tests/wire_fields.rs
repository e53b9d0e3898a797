//! Every field an error names (`kvtier_core::wire`) is a field path of each
//! request message it is listed for, checked against the descriptor the
//! server offers for reflection.

use std::collections::HashMap;

use kvtier_core::wire;
use prost::Message;
use prost_types::{DescriptorProto, FileDescriptorSet};

/// Whether `path` (dot-separated, indices stripped) names a field of
/// `message`, or ends in one of its oneofs.
fn has_path(messages: &HashMap<String, &DescriptorProto>, message: &DescriptorProto, path: &str) -> bool {
    let (head, rest) = match path.split_once('.') {
        Some((head, rest)) => (head, Some(rest)),
        None => (path, None),
    };
    if let Some(field) = message.field.iter().find(|f| f.name() == head) {
        return match rest {
            None => true,
            Some(rest) => messages
                .get(field.type_name())
                .is_some_and(|inner| has_path(messages, inner, rest)),
        };
    }
    rest.is_none() && message.oneof_decl.iter().any(|o| o.name() == head)
}

#[test]
fn every_field_an_error_names_is_a_proto_path_of_its_requests() {
    let set = FileDescriptorSet::decode(kvtier_proto::FILE_DESCRIPTOR_SET).unwrap();
    let mut messages = HashMap::new();
    for file in &set.file {
        for m in &file.message_type {
            messages.insert(format!(".{}.{}", file.package(), m.name()), m);
        }
    }
    let mut wrong = Vec::new();
    for field in wire::ALL {
        for request in field.requests {
            let Some(message) = messages.get(&format!(".kvtier.v1.{request}")) else {
                wrong.push(format!("{request} is not a message of kvtier.v1"));
                continue;
            };
            if !has_path(&messages, message, field.path) {
                wrong.push(format!("{request} has no field {}", field.path));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // The check itself can fail: a name that drifted is caught.
    let set_state = messages[".kvtier.v1.SetPageStateRequest"];
    assert!(!has_path(&messages, set_state, "summary_rows"));
    assert!(!has_path(&messages, set_state, "action.summarize.rows"));
    assert!(has_path(&messages, set_state, "summarize.rows"));
}
