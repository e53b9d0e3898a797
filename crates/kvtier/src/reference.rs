//! docs/REFERENCE.md, generated from the code: every command's flags (the
//! clap definitions), every config key (the serde definitions, described by
//! kvtier.example.toml), every metric (a real server's `/metrics`) and
//! every RPC's status codes (the proto). The test fails when the file and
//! the code disagree; `KVTIER_BLESS=1 cargo test -p kvtier reference`
//! rewrites it.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

use clap::CommandFactory;

use crate::config::FileConfig;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// One cell of a markdown table: no newlines, pipes escaped.
fn cell(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

fn commands(out: &mut String) {
    fn walk(command: &clap::Command, path: &str, out: &mut String) {
        let args: Vec<_> = command
            .get_arguments()
            .filter(|a| !a.is_hide_set() && a.get_id() != "help" && a.get_id() != "version")
            .collect();
        if !args.is_empty() {
            let about = command.get_about().map(|a| a.to_string()).unwrap_or_default();
            let _ = writeln!(out, "### `{path}`\n\n{}\n", cell(&about));
            out.push_str("| flag | value | env | description |\n|---|---|---|---|\n");
            for arg in args {
                let flag = match (arg.get_long(), arg.is_positional()) {
                    (Some(long), _) => format!("`--{long}`"),
                    (None, _) => format!("`{}`", arg.get_id()),
                };
                let value = arg
                    .get_value_names()
                    .map(|names| names.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(" "))
                    .unwrap_or_default();
                let mut help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
                let defaults: Vec<_> = arg
                    .get_default_values()
                    .iter()
                    .map(|d| d.to_string_lossy().into_owned())
                    .collect();
                if !defaults.is_empty() && !help.contains("[default:") {
                    let _ = write!(help, " [default: {}]", defaults.join(", "));
                }
                let env = arg
                    .get_env()
                    .map(|e| format!("`{}`", e.to_string_lossy()))
                    .unwrap_or_default();
                let _ = writeln!(out, "| {flag} | {} | {env} | {} |", cell(&value), cell(&help));
            }
            out.push('\n');
        }
        for sub in command
            .get_subcommands()
            .filter(|s| !s.is_hide_set() && s.get_name() != "help")
        {
            walk(sub, &format!("{path} {}", sub.get_name()), out);
        }
    }
    out.push_str("## Commands and flags\n\nFrom the clap definitions (`kvtier <command> --help` says the same).\n\n");
    walk(&crate::Cli::command(), "kvtier", out);
}

/// The fields a TOML table at `header` (`[a.b]`, `[[a.b]]`, or none for the
/// top level) accepts, read off serde's refusal of an unknown one: every
/// table of the config denies unknown fields and names those it expects.
/// `None`: no table can stand there.
fn fields_at(header: &str) -> Option<Vec<String>> {
    const PROBE: &str = "kvtier_reference_probe";
    let text = format!("{header}\n{PROBE} = 1\n");
    let error = toml::from_str::<FileConfig>(&text).err()?.to_string();
    let rest = &error[error.find(&format!("unknown field `{PROBE}`"))?..];
    let expected = rest.split_once("expected").map_or("", |(_, e)| e);
    Some(expected.split('`').skip(1).step_by(2).map(str::to_owned).collect())
}

/// Every config key, dotted (`tiers.device_bytes`; `*` for a map's keys,
/// `[]` after an array of tables), from the serde definitions.
fn config_keys() -> Vec<String> {
    fn walk(path: &str, header: &str, keys: &mut Vec<String>) {
        for field in fields_at(header).expect("a table") {
            let key = if path.is_empty() {
                field
            } else {
                format!("{path}.{field}")
            };
            let bare = key.replace("[]", "").replace('*', "kvtier_name");
            if fields_at(&format!("[{bare}]")).is_some() {
                walk(&key, &format!("[{bare}]"), keys);
            } else if fields_at(&format!("[[{bare}]]")).is_some() {
                walk(&format!("{key}[]"), &format!("[[{bare}]]"), keys);
            } else if fields_at(&format!("[{bare}.kvtier_name]")).is_some() {
                walk(&format!("{key}.*"), &format!("[{bare}.kvtier_name]"), keys);
            } else {
                keys.push(key);
            }
        }
    }
    let mut keys = Vec::new();
    walk("", "", &mut keys);
    keys
}

/// The keys kvtier.example.toml shows (set or commented out) with the
/// comments beside them, dotted as [`config_keys`] spells them.
fn example_keys(example: &str) -> BTreeMap<String, (String, String)> {
    let mut keys = BTreeMap::new();
    let mut table = String::new();
    let mut last: Option<String> = None;
    for line in example.lines() {
        let uncommented = line.trim().trim_start_matches('#').trim();
        if let Some(header) = uncommented.strip_prefix('[').and_then(|h| h.split(']').next()) {
            let array = header.starts_with('[');
            let name = header.trim_start_matches('[');
            // `[limits.tenants.a]`: one key of the `tenants` map.
            table = match name.strip_prefix("limits.tenants.") {
                Some(_) => "limits.tenants.*".to_owned(),
                None if array => format!("{name}[]"),
                None => name.to_owned(),
            };
            last = None;
            continue;
        }
        if let Some((key, rest)) = uncommented.split_once('=')
            && !key.trim().is_empty()
            && key
                .trim()
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
        {
            let key = key.trim();
            let (value, comment) = rest.split_once('#').unwrap_or((rest, ""));
            let dotted = if table.is_empty() {
                key.to_owned()
            } else {
                format!("{table}.{key}")
            };
            // A key shown twice (two tokens) is described where it has a comment.
            let entry = keys
                .entry(dotted.clone())
                .or_insert_with(|| (String::new(), String::new()));
            if entry.1.is_empty() {
                *entry = (value.trim().to_owned(), comment.trim().to_owned());
            }
            last = Some(dotted);
        } else if let (Some(key), true) = (&last, line.starts_with(' ') && uncommented != line.trim()) {
            // An aligned comment line continues the key above.
            if let Some((_, comment)) = keys.get_mut(key) {
                comment.push(' ');
                comment.push_str(uncommented);
            }
        } else {
            last = None;
        }
    }
    keys
}

fn config(out: &mut String) {
    let example = std::fs::read_to_string(repo().join("kvtier.example.toml")).expect("kvtier.example.toml");
    let documented = example_keys(&example);
    let keys = config_keys();
    let missing: Vec<_> = keys.iter().filter(|k| !documented.contains_key(*k)).collect();
    let unknown: Vec<_> = documented.keys().filter(|k| !keys.contains(k)).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "kvtier.example.toml and the config's serde definitions disagree: keys the server takes that the \
         example does not show: {missing:?}; keys the example shows that the server refuses: {unknown:?}"
    );
    let undescribed: Vec<_> = keys.iter().filter(|k| documented[*k].1.is_empty()).collect();
    assert!(
        undescribed.is_empty(),
        "kvtier.example.toml shows these keys without a comment saying what they do: {undescribed:?}"
    );
    out.push_str(
        "## Configuration keys\n\nThe keys `kvtier serve --config FILE` accepts (from the serde definitions; any \
         other key is refused), with the example and comment of [kvtier.example.toml](../kvtier.example.toml). \
         `*` stands for a tenant's name, `[]` for one entry of an array of tables. Flags override the file.\n\n\
         | key | example | description |\n|---|---|---|\n",
    );
    for key in &keys {
        let (value, comment) = &documented[key];
        let _ = writeln!(out, "| `{key}` | `{}` | {} |", cell(value), cell(comment));
    }
    out.push('\n');
}

/// A sequence's life, so that labelled families have series to show their
/// labels: writes, a selection with a swap-in, a fetch, a refused call, a
/// drop.
async fn traffic(addr: &str) {
    use kvtier_client::{Client, SelectRequest, layout, pb};
    let mut client = Client::connect(addr.to_owned()).await.unwrap();
    let (tokens, dim) = (16u32, 8u32);
    client
        .create_sequence("reference", layout(1, 1, 1, dim, pb::DType::DtypeF32, 4), vec![])
        .await
        .unwrap();
    let kv: Vec<u8> = (0..2 * tokens * dim).flat_map(|i| (i as f32).to_le_bytes()).collect();
    client
        .put_pages("reference", 0, 0..1, 0, tokens, kv.into())
        .await
        .unwrap();
    let mut select = SelectRequest::new(0, 0..1, vec![1.0; dim as usize], 2);
    select.swap_in = true;
    select.include_data = true;
    client.select_pages("reference", &select).await.unwrap();
    client.fetch_pages("reference", 0, 0..1, vec![0, 1]).await.unwrap();
    assert!(client.get_sequence("no-such-sequence").await.is_err());
    client.drop_sequence("reference").await.unwrap();
}

/// A real server's `/metrics` after [`traffic`], scraped over loopback.
fn scrape() -> String {
    use std::io::{Read, Write as _};
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let addr = runtime.block_on(async {
        let store = kvtier_store::Store::new(kvtier_store::StoreConfig {
            device_bytes: 1 << 20,
            host_bytes: 1 << 20,
            ..Default::default()
        })
        .unwrap();
        let config = kvtier_server::ServerConfig {
            listen: ([127, 0, 0, 1], 0).into(),
            metrics_listen: Some(([127, 0, 0, 1], 0).into()),
            ..Default::default()
        };
        let bound = kvtier_server::BoundServer::bind(store, config).await.unwrap();
        let grpc = format!("http://{}", bound.grpc_addr());
        let addr = bound.metrics_addr().unwrap();
        tokio::spawn(bound.serve(std::future::pending()));
        traffic(&grpc).await;
        addr
    });
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: kvtier\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    runtime.shutdown_background();
    reply
}

fn metrics(out: &mut String) {
    out.push_str(
        "## Metrics\n\nEvery family a server's `/metrics` serves (scraped from a real server after one \
         sequence's writes, selection, fetch and drop; a label that no series had by then is not listed). The [Grafana dashboard](../docker/grafana/dashboards/kvtier.json) \
         charts them.\n\n| metric | type | labels | description |\n|---|---|---|---|\n",
    );
    let text = scrape();
    let mut families: Vec<(String, String, String)> = Vec::new();
    let mut labels: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            families.push((name.to_owned(), String::new(), help.to_owned()));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            if let Some(family) = families.iter_mut().find(|f| f.0 == name) {
                family.1 = kind.to_owned();
            }
        } else if let Some((series, _)) = line.split_once('{') {
            let name = families
                .iter()
                .map(|f| f.0.as_str())
                .find(|f| series == *f || series.strip_prefix(f).is_some_and(|s| s.starts_with('_')));
            if let Some(name) = name {
                let set = labels.entry(name.to_owned()).or_default();
                for pair in line[series.len() + 1..].split('}').next().unwrap_or("").split(',') {
                    if let Some((label, _)) = pair.split_once('=')
                        && label != "le"
                    {
                        set.insert(label.to_owned());
                    }
                }
            }
        }
    }
    assert!(
        families.len() > 10,
        "the scrape served {} families:\n{text}",
        families.len()
    );
    for (name, kind, help) in families {
        let names = labels.get(&name).map_or(String::new(), |set| {
            set.iter().map(|l| format!("`{l}`")).collect::<Vec<_>>().join(", ")
        });
        let _ = writeln!(out, "| `{name}` | {kind} | {names} | {} |", cell(&help));
    }
    out.push('\n');
}

fn status_codes(out: &mut String) {
    let proto = std::fs::read_to_string(repo().join("proto/kvtier/v1/kvtier.proto")).expect("the proto");
    out.push_str(
        "## Status codes per RPC\n\nFrom the comments of [kvtier.proto](../proto/kvtier/v1/kvtier.proto), whose \
         header says what each code means. Every method may also return UNAUTHENTICATED and PERMISSION_DENIED \
         (tokens), RESOURCE_EXHAUSTED for an oversized request or a full in-flight budget, and, in a cluster, \
         FAILED_PRECONDITION, UNAVAILABLE, DATA_LOSS and NOT_FOUND for a sequence elsewhere, out of reach, lost or \
         created again.\n\n| RPC | codes |\n|---|---|\n",
    );
    let mut comment = String::new();
    for line in proto.lines() {
        let line = line.trim();
        if let Some(text) = line.strip_prefix("//") {
            comment.push_str(text);
            comment.push(' ');
        } else if let Some(rest) = line.strip_prefix("rpc ") {
            let name = rest.split('(').next().unwrap_or(rest);
            let codes = comment
                .split_once("Codes:")
                .map(|(_, codes)| cell(codes))
                .unwrap_or_else(|| panic!("rpc {name}: its comment lists no `Codes:`"));
            let _ = writeln!(out, "| `{name}` | {codes} |");
            comment.clear();
        } else {
            comment.clear();
        }
    }
    out.push('\n');
}

fn generate() -> String {
    let mut out = String::from(
        "# kvtier reference\n\nGenerated from the code by `crates/kvtier/src/reference.rs`; a test fails when \
         this file and the code disagree (`KVTIER_BLESS=1 cargo test -p kvtier reference` rewrites it). Do not \
         edit by hand.\n\n- [Commands and flags](#commands-and-flags)\n- [Configuration keys](#configuration-keys)\n\
         - [Metrics](#metrics)\n- [Status codes per RPC](#status-codes-per-rpc)\n\n",
    );
    commands(&mut out);
    config(&mut out);
    metrics(&mut out);
    status_codes(&mut out);
    out.truncate(out.trim_end().len());
    out.push('\n');
    out
}

#[test]
fn reference_is_generated_from_the_code() {
    let path = repo().join("docs/REFERENCE.md");
    let generated = generate();
    if std::env::var_os("KVTIER_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        let line = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(committed.lines().count().min(generated.lines().count()));
        panic!(
            "docs/REFERENCE.md is not what the code generates (first difference at line {}: {:?} against {:?}); \
             run KVTIER_BLESS=1 cargo test -p kvtier reference",
            line + 1,
            committed.lines().nth(line),
            generated.lines().nth(line)
        );
    }
}

#[test]
fn the_example_parser_reads_keys_tables_and_continuations() {
    let keys = example_keys(
        "listen = \"x\" # where\n[tiers]\ndevice_policy = \"lru\"  # lru, or loop:\n                         # more\n\
         # [[auth.tokens]]\n# token = \"t\"\n# [limits.tenants.a]\n# sequences = 1000\n",
    );
    assert_eq!(keys["listen"], ("\"x\"".to_owned(), "where".to_owned()));
    assert_eq!(keys["tiers.device_policy"].1, "lru, or loop: more");
    assert!(keys.contains_key("auth.tokens[].token"));
    assert!(keys.contains_key("limits.tenants.*.sequences"));
}
