//! Server configuration: embedded defaults, then a TOML file, then flags.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::Context;
use serde::Deserialize;

/// A byte count written as `4GiB`, `512MiB`, `64KiB`, `1G`, `1000` (binary
/// units for `*iB`, decimal for `K`/`M`/`G`/`T`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ByteSize(pub(crate) u64);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (digits, unit) = s.split_at(split);
        let n: u64 = digits
            .parse()
            .map_err(|_| format!("{s:?} is not a byte size like 4GiB, 512MiB or 1000"))?;
        let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" => 1_000,
            "m" | "mb" => 1_000_000,
            "g" | "gb" => 1_000_000_000,
            "t" | "tb" => 1_000_000_000_000,
            "kib" => 1 << 10,
            "mib" => 1 << 20,
            "gib" => 1 << 30,
            "tib" => 1 << 40,
            other => {
                return Err(format!(
                    "unknown unit {other:?} in {s:?} (use B, KiB, MiB, GiB, TiB, K, M, G, T)"
                ));
            }
        };
        n.checked_mul(scale)
            .map(ByteSize)
            .ok_or_else(|| format!("{s:?} overflows 64 bits"))
    }
}

/// In the largest binary unit that keeps it at least 1, as a log shows it:
/// `1.0 GiB`, `512.0 MiB`, `4096 B`.
impl std::fmt::Display for ByteSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let units = [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)];
        match units.iter().find(|(_, shift)| self.0 >= 1 << shift) {
            Some((unit, shift)) => write!(f, "{:.1} {unit}", self.0 as f64 / (1u64 << shift) as f64),
            None => write!(f, "{} B", self.0),
        }
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(ByteSize(n)),
            Raw::Text(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// The file format; every key is optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileConfig {
    pub(crate) listen: Option<SocketAddr>,
    /// `"off"` disables metrics.
    pub(crate) metrics_listen: Option<String>,
    pub(crate) data_dir: Option<PathBuf>,
    pub(crate) max_message_bytes: Option<ByteSize>,
    pub(crate) max_inflight_bytes: Option<ByteSize>,
    pub(crate) max_connections: Option<usize>,
    /// Serve off loopback without tokens or TLS.
    pub(crate) insecure: Option<bool>,
    /// The shm data plane's registration socket; `"off"` disables it.
    pub(crate) shm_socket: Option<String>,
    /// How long a region's connection thread polls for the next call, µs.
    pub(crate) shm_poll_us: Option<u64>,
    /// The longest poll for the next call a region's call may ask for, µs.
    pub(crate) shm_poll_max_us: Option<u64>,
    pub(crate) tls: Option<TlsFileConfig>,
    #[serde(default)]
    pub(crate) auth: AuthFileConfig,
    #[serde(default)]
    pub(crate) limits: LimitsFileConfig,
    /// `relaxed` or `fsync`.
    pub(crate) durability: Option<String>,
    /// Rewrite the manifest as a checkpoint past this size.
    pub(crate) checkpoint_bytes: Option<ByteSize>,
    #[serde(default)]
    pub(crate) tiers: TierFileConfig,
    #[serde(default)]
    pub(crate) access_trace: AccessTraceFileConfig,
    /// Membership of a cluster (etcd).
    #[serde(default)]
    pub(crate) cluster: crate::cluster::ClusterFileConfig,
}

/// Page-access recording (`kvtier tune`'s input).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AccessTraceFileConfig {
    /// Record from startup into this file.
    pub(crate) path: Option<PathBuf>,
    /// The share of pages recorded, in (0, 1].
    pub(crate) sample: Option<f64>,
    /// The file stops growing here.
    pub(crate) max_bytes: Option<ByteSize>,
    /// Where recordings started over gRPC go (default `<data_dir>/traces`).
    pub(crate) dir: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TierFileConfig {
    pub(crate) device_bytes: Option<ByteSize>,
    pub(crate) host_bytes: Option<ByteSize>,
    pub(crate) cache_writes_on_device: Option<bool>,
    /// 0 disables the NVMe tier.
    pub(crate) nvme_bytes: Option<ByteSize>,
    /// Default: `<data_dir>/nvme.data`. A block device works too.
    pub(crate) nvme_path: Option<PathBuf>,
    pub(crate) nvme_engine: Option<String>,
    pub(crate) nvme_queue_depth: Option<u32>,
    pub(crate) host_high_watermark: Option<f64>,
    pub(crate) host_low_watermark: Option<f64>,
    pub(crate) promote_on_read: Option<bool>,
    /// Sketches of NVMe-only pages leave host memory.
    pub(crate) spill_sketches: Option<bool>,
    /// `kernel` or `copy_engine`.
    pub(crate) swap_in_path: Option<String>,
    /// `inclusive` or `exclusive`.
    pub(crate) device_cache: Option<String>,
    /// `lru` or `loop`.
    pub(crate) device_policy: Option<String>,
    /// `lru` or `frequency`.
    pub(crate) host_policy: Option<String>,
}

/// The metadata budget and tenants' quotas.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LimitsFileConfig {
    pub(crate) metadata_bytes: Option<ByteSize>,
    #[serde(default)]
    pub(crate) default_quota: QuotaFileConfig,
    #[serde(default)]
    pub(crate) tenants: std::collections::BTreeMap<String, QuotaFileConfig>,
}

#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct QuotaFileConfig {
    pub(crate) sequences: Option<u64>,
    pub(crate) metadata_bytes: Option<ByteSize>,
    pub(crate) device_bytes: Option<ByteSize>,
    pub(crate) host_bytes: Option<ByteSize>,
    pub(crate) nvme_bytes: Option<ByteSize>,
}

impl QuotaFileConfig {
    fn quota(self) -> kvtier_store::Quota {
        kvtier_store::Quota {
            sequences: self.sequences,
            metadata_bytes: self.metadata_bytes.map(|b| b.0),
            device_bytes: self.device_bytes.map(|b| b.0),
            host_bytes: self.host_bytes.map(|b| b.0),
            nvme_bytes: self.nvme_bytes.map(|b| b.0),
        }
    }
}

impl LimitsFileConfig {
    /// The limits, with `metadata_bytes` from a flag overriding the file's.
    pub(crate) fn limits(&self, metadata_bytes: Option<ByteSize>) -> anyhow::Result<kvtier_store::Limits> {
        let defaults = kvtier_store::Limits::default();
        let mut tenants = std::collections::BTreeMap::new();
        for (name, quota) in &self.tenants {
            let tenant =
                kvtier_core::TenantId::parse(&format!("limits.tenants.{name}"), name).map_err(anyhow::Error::msg)?;
            tenants.insert(tenant, quota.quota());
        }
        Ok(kvtier_store::Limits {
            metadata_bytes: metadata_bytes
                .or(self.metadata_bytes)
                .map_or(defaults.metadata_bytes, |b| b.0),
            default_quota: self.default_quota.quota(),
            tenants,
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TlsFileConfig {
    /// PEM certificate chain.
    pub(crate) cert: PathBuf,
    /// PEM private key.
    pub(crate) key: PathBuf,
    /// The authority (PEM) that `kvtier health --config` checks the
    /// server's certificate against; default: `cert` itself (self-signed).
    pub(crate) ca: Option<PathBuf>,
    /// The name `kvtier health --config` expects the certificate to carry;
    /// default: `localhost`.
    pub(crate) domain: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AuthFileConfig {
    #[serde(default)]
    pub(crate) tokens: Vec<TokenFileConfig>,
}

/// One bearer token: for one tenant, or (`admin = true`) for all of them
/// and for server-wide statistics.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TokenFileConfig {
    pub(crate) token: String,
    pub(crate) tenant: Option<String>,
    #[serde(default)]
    pub(crate) admin: bool,
}

impl AuthFileConfig {
    pub(crate) fn auth(&self) -> anyhow::Result<kvtier_server::Auth> {
        use kvtier_server::{Auth, Grant, Token};
        let mut tokens = Vec::new();
        for (i, t) in self.tokens.iter().enumerate() {
            let field = format!("auth.tokens[{i}]");
            if t.token.len() < 16 {
                anyhow::bail!("{field}.token: is {} characters, at least 16 needed", t.token.len());
            }
            let grant = match (&t.tenant, t.admin) {
                (Some(tenant), false) => Grant::Tenant(
                    kvtier_core::TenantId::parse(&format!("{field}.tenant"), tenant).map_err(anyhow::Error::msg)?,
                ),
                (None, true) => Grant::Admin,
                _ => anyhow::bail!("{field}: give either tenant = \"...\" or admin = true"),
            };
            if tokens.iter().any(|other: &Token| other.secret == t.token) {
                anyhow::bail!("{field}.token: the same token is configured twice");
            }
            tokens.push(Token {
                secret: t.token.clone(),
                grant,
            });
        }
        Ok(Auth::new(tokens))
    }
}

impl FileConfig {
    pub(crate) fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading config {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing config {}", path.display()))
    }
}

/// The default metadata budget: the page index alone (digest and key
/// sketches) is about a fifth of the KV bytes it indexes, wherever they
/// are, so a quarter of what the host and NVMe tiers hold — but never more
/// than half the memory available (a huge NVMe tier must not disarm the
/// limit), and at least 1 GiB where that much is available.
pub(crate) fn default_metadata_bytes(host_bytes: u64, nvme_bytes: u64, available: u64) -> u64 {
    (host_bytes.saturating_add(nvme_bytes) / 4)
        .max(1 << 30)
        .min(available / 2)
}

/// The default in-flight budget: 1 GiB, or an eighth of the memory
/// available (a small container's), but always room for one request and
/// one response of the largest message.
pub(crate) fn default_inflight_bytes(max_message_bytes: u64, available: u64) -> u64 {
    (1u64 << 30).min(available / 8).max(2 * max_message_bytes)
}

/// Default tier sizes for this machine or container: a quarter of the
/// available memory (under the cgroup's limit) for the host tier, at most
/// 8 GiB, and a sixteenth for the emulated device, at most 1 GiB, so a
/// default server leaves most of its machine or container to others.
pub(crate) fn default_tier_bytes(available: u64) -> (u64, u64) {
    ((available / 16).min(1 << 30), (available / 4).min(8 << 30))
}

/// Default NVMe tier size: a quarter of the free space where it will live,
/// at most 16 GiB. The file is sparse: it takes disk space only as pages
/// land on it.
pub(crate) fn default_nvme_bytes(dir: &Path) -> u64 {
    let free = free_space(dir).unwrap_or(4 << 30);
    (free / 4).min(16 << 30)
}

fn free_space(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is a valid NUL-terminated string and `stat` points to
    // writable memory of the right type; statvfs fills it on success.
    let ok = unsafe { libc::statvfs(path.as_ptr(), stat.as_mut_ptr()) } == 0;
    // SAFETY: statvfs returned 0, so it initialised `stat`.
    ok.then(|| unsafe { stat.assume_init() })
        .map(|s| s.f_bavail.saturating_mul(s.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_inflight_budget_shrinks_with_memory_but_holds_two_messages() {
        const MIB: u64 = 1 << 20;
        assert_eq!(default_inflight_bytes(64 * MIB, 64 * 1024 * MIB), 1024 * MIB);
        assert_eq!(default_inflight_bytes(64 * MIB, 2048 * MIB), 256 * MIB);
        assert_eq!(default_inflight_bytes(64 * MIB, 512 * MIB), 128 * MIB);
    }

    #[test]
    fn the_default_metadata_budget_follows_the_tiers_within_memory() {
        const GIB: u64 = 1 << 30;
        // A quarter of host + NVMe.
        assert_eq!(default_metadata_bytes(8 * GIB, 16 * GIB, 64 * GIB), 6 * GIB);
        // Never more than half of what is available...
        assert_eq!(default_metadata_bytes(8 * GIB, 4096 * GIB, 64 * GIB), 32 * GIB);
        // ...and at least 1 GiB, where memory allows (a container limit).
        assert_eq!(default_metadata_bytes(GIB, GIB, 4 * GIB), GIB);
        assert_eq!(default_metadata_bytes(GIB, GIB, GIB), GIB / 2);
    }

    #[test]
    fn byte_sizes_parse_with_units() {
        for (text, bytes) in [
            ("1000", 1000),
            ("4GiB", 4 << 30),
            ("512 MiB", 512 << 20),
            ("64kib", 64 << 10),
            ("1G", 1_000_000_000),
        ] {
            assert_eq!(text.parse::<ByteSize>(), Ok(ByteSize(bytes)), "{text}");
        }
        assert!("4 parsecs".parse::<ByteSize>().is_err());
        assert!("GiB".parse::<ByteSize>().is_err());
        assert!("99999999999TiB".parse::<ByteSize>().is_err());
        assert_eq!(ByteSize(1 << 30).to_string(), "1.0 GiB");
        assert_eq!(ByteSize(3 << 19).to_string(), "1.5 MiB");
        assert_eq!(ByteSize(1000).to_string(), "1000 B");
    }

    #[test]
    fn config_files_reject_unknown_keys() {
        let ok: FileConfig =
            toml::from_str("listen = \"127.0.0.1:1\"\n[tiers]\nhost_bytes = \"1GiB\"\ndevice_bytes = 4096\n").unwrap();
        assert_eq!(ok.tiers.host_bytes, Some(ByteSize(1 << 30)));
        assert_eq!(ok.tiers.device_bytes, Some(ByteSize(4096)));
        assert!(toml::from_str::<FileConfig>("lisen = \"127.0.0.1:1\"").is_err());
    }

    #[test]
    fn the_example_config_parses() {
        let example: FileConfig = toml::from_str(include_str!("../../../kvtier.example.toml")).unwrap();
        assert_eq!(example.tiers.host_bytes, Some(ByteSize(8 << 30)));
        assert_eq!(example.metrics_listen.as_deref(), Some("127.0.0.1:9464"));
        // And with every commented key on.
        let uncommented: String = include_str!("../../../kvtier.example.toml")
            .lines()
            .map(|l| {
                l.strip_prefix("# ")
                    .filter(|l| !l.contains(' ') || l.contains('=') || l.starts_with('['))
                    .unwrap_or(l)
            })
            .filter(|l| !l.starts_with("kvtier serve") && !l.starts_with("Every key") && !l.starts_with("nvme_path"))
            .collect::<Vec<_>>()
            .join("\n");
        let all: FileConfig = toml::from_str(&uncommented).unwrap();
        assert_eq!(all.auth.tokens.len(), 2);
        assert!(all.tls.is_some());
        let limits = all.limits.limits(None).unwrap();
        assert_eq!(limits.default_quota.sequences, Some(10_000));
        let a = kvtier_core::TenantId::parse("t", "a").unwrap();
        assert_eq!(limits.tenants[&a].host_bytes, Some(2 << 30));
        assert!(all.auth.auth().unwrap().enabled());
    }

    #[test]
    fn tokens_are_long_unique_and_either_a_tenants_or_the_admins() {
        let auth = |text: &str| {
            toml::from_str::<FileConfig>(text)
                .unwrap()
                .auth
                .auth()
                .map_err(|e| e.to_string())
        };
        let long = "0123456789abcdef";
        let err = auth("[[auth.tokens]]\ntoken = \"short\"\ntenant = \"a\"").unwrap_err();
        assert!(err.starts_with("auth.tokens[0].token:"), "{err}");
        let err = auth(&format!(
            "[[auth.tokens]]\ntoken = \"{long}\"\ntenant = \"a\"\nadmin = true"
        ))
        .unwrap_err();
        assert!(err.starts_with("auth.tokens[0]:"), "{err}");
        let err = auth(&format!("[[auth.tokens]]\ntoken = \"{long}\"")).unwrap_err();
        assert!(err.contains("either tenant"), "{err}");
        let twice = format!(
            "[[auth.tokens]]\ntoken = \"{long}\"\ntenant = \"a\"\n[[auth.tokens]]\ntoken = \"{long}\"\nadmin = true"
        );
        assert!(auth(&twice).unwrap_err().starts_with("auth.tokens[1].token:"));
        let err = auth(&format!("[[auth.tokens]]\ntoken = \"{long}\"\ntenant = \"no spaces\"")).unwrap_err();
        assert!(err.contains("auth.tokens[0].tenant"), "{err}");
    }
}
