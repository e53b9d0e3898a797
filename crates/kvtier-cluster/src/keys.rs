//! Where a cluster's records live in etcd: everything under
//! `/kvtier/<cluster>/`, so clusters share one etcd without meeting.

use kvtier_core::SequenceKey;

/// The etcd keys of one cluster's records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    root: String,
}

impl Keys {
    /// The keys of the cluster named `cluster`.
    pub fn new(cluster: &str) -> Self {
        Self {
            root: format!("/kvtier/{cluster}/"),
        }
    }

    /// Node records, one per member, under its membership lease.
    pub fn nodes(&self) -> String {
        format!("{}nodes/", self.root)
    }

    /// One node's record.
    pub fn node(&self, node_id: &str) -> String {
        format!("{}{node_id}", self.nodes())
    }

    /// Present while a node's sequences are still its own: under the node's
    /// grace lease, which outlives its membership lease by the grace period.
    pub fn held(&self, node_id: &str) -> String {
        format!("{}held/{node_id}", self.root)
    }

    /// Ownership records.
    pub fn sequences(&self) -> String {
        format!("{}seqs/", self.root)
    }

    /// A sequence's ownership record. The id is hex-encoded: ids may hold
    /// any character but control characters, `/` included.
    pub fn sequence(&self, key: &SequenceKey) -> String {
        let mut out = format!("{}{}/", self.sequences(), key.tenant.as_str());
        for b in key.sequence.as_str().as_bytes() {
            out.push_str(&format!("{b:02x}"));
        }
        out
    }

    /// The sequence a record's key names, if it is one of this cluster's.
    pub fn parse_sequence(&self, etcd_key: &[u8]) -> Option<SequenceKey> {
        let rest = std::str::from_utf8(etcd_key).ok()?.strip_prefix(&self.sequences())?;
        let (tenant, hex) = rest.split_once('/')?;
        if hex.len() % 2 != 0 {
            return None;
        }
        let bytes: Option<Vec<u8>> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
            .collect();
        let id = String::from_utf8(bytes?).ok()?;
        SequenceKey::parse(tenant, &id).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_key_round_trips_through_its_record_key() {
        let keys = Keys::new("c1");
        let key = SequenceKey::parse("t-1", "a/b é").unwrap();
        let k = keys.sequence(&key);
        assert!(k.starts_with("/kvtier/c1/seqs/t-1/"), "{k}");
        assert_eq!(keys.parse_sequence(k.as_bytes()), Some(key));
        assert_eq!(Keys::new("c2").parse_sequence(k.as_bytes()), None);
        assert_eq!(keys.parse_sequence(b"/kvtier/c1/seqs/t/abc"), None);
    }
}
