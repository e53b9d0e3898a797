//! How much memory this server may take: what the machine has available,
//! capped by the memory limit of the cgroup it runs in (a container's
//! `docker run -m`, a systemd unit's `MemoryMax`), so that default tier
//! sizes never invite the OOM killer.

use std::path::{Path, PathBuf};

/// The memory the server may still take, in bytes: the host's
/// `MemAvailable`, or the room left under the tightest cgroup limit when
/// that is less. `None` when neither can be read.
pub(crate) fn available_memory() -> Option<u64> {
    let host = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| mem_available(&text));
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|text| cgroup_room(&text, Path::new("/sys/fs/cgroup")));
    match (host, cgroup) {
        (Some(h), Some(c)) => Some(h.min(c)),
        (h, c) => h.or(c),
    }
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The least room (limit less usage) over the memory cgroups that hold this
/// process, under the cgroup mount `root`: v2 (`memory.max`,
/// `memory.current`) or v1 (`memory/memory.limit_in_bytes`,
/// `memory.usage_in_bytes`). Each is looked for at the process's own
/// cgroup path, every path above it, and the mount's root, which is the
/// container's own cgroup inside a container. Usage counts the page cache,
/// so the room is on the safe side. `None`: no limit found.
fn cgroup_room(proc_self_cgroup: &str, root: &Path) -> Option<u64> {
    let mut dirs: Vec<(PathBuf, &str, &str)> = Vec::new();
    for line in proc_self_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        // The process's cgroup and every one above it: a parent's limit
        // (a systemd slice, a pod) binds as much as its own.
        let mut relative = Path::new(path.trim_start_matches('/'));
        loop {
            if controllers.is_empty() {
                dirs.push((root.join(relative), "memory.max", "memory.current"));
            } else if controllers.split(',').any(|c| c == "memory") {
                dirs.push((
                    root.join("memory").join(relative),
                    "memory.limit_in_bytes",
                    "memory.usage_in_bytes",
                ));
            }
            match relative.parent() {
                Some(parent) => relative = parent,
                None => break,
            }
        }
    }
    dirs.push((root.to_path_buf(), "memory.max", "memory.current"));
    dirs.push((root.join("memory"), "memory.limit_in_bytes", "memory.usage_in_bytes"));
    dirs.iter()
        .filter_map(|(dir, limit, usage)| {
            let limit = read_bytes(&dir.join(limit))?;
            let usage = read_bytes(&dir.join(usage)).unwrap_or(0);
            Some(limit.saturating_sub(usage))
        })
        .min()
}

/// A cgroup memory file's number; `max` (v2's "no limit") is none.
fn read_bytes(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn meminfo_is_read_in_kib() {
        let text = "MemTotal:       16 kB\nMemFree:        1 kB\nMemAvailable:   8 kB\n";
        assert_eq!(mem_available(text), Some(8192));
    }

    #[test]
    fn a_v2_limit_leaves_its_room() {
        let root = tempfile::tempdir().unwrap();
        write(&root.path().join("kvtier.service"), "memory.max", "2147483648\n");
        write(&root.path().join("kvtier.service"), "memory.current", "1073741824\n");
        assert_eq!(cgroup_room("0::/kvtier.service\n", root.path()), Some(1 << 30));
    }

    #[test]
    fn a_parents_limit_binds_its_children() {
        let root = tempfile::tempdir().unwrap();
        write(&root.path().join("pods.slice"), "memory.max", "1000\n");
        write(&root.path().join("pods.slice"), "memory.current", "100\n");
        write(&root.path().join("pods.slice/kvtier"), "memory.max", "max\n");
        assert_eq!(cgroup_room("0::/pods.slice/kvtier\n", root.path()), Some(900));
    }

    #[test]
    fn max_is_no_limit() {
        let root = tempfile::tempdir().unwrap();
        write(root.path(), "memory.max", "max\n");
        assert_eq!(cgroup_room("0::/\n", root.path()), None);
    }

    #[test]
    fn a_v1_container_sees_its_limit_at_the_mount_root() {
        // Docker with cgroup v1 mounts the container's own memory cgroup at
        // /sys/fs/cgroup/memory while /proc/self/cgroup names the host path.
        let root = tempfile::tempdir().unwrap();
        write(&root.path().join("memory"), "memory.limit_in_bytes", "2147483648\n");
        write(&root.path().join("memory"), "memory.usage_in_bytes", "0\n");
        let cgroup = "9:memory:/docker/0123abcd\n8:cpu,cpuacct:/docker/0123abcd\n1:name=systemd:/docker/0123abcd\n";
        assert_eq!(cgroup_room(cgroup, root.path()), Some(2 << 30));
    }

    #[test]
    fn the_tightest_limit_wins() {
        let root = tempfile::tempdir().unwrap();
        write(&root.path().join("memory/job"), "memory.limit_in_bytes", "1000\n");
        write(&root.path().join("memory/job"), "memory.usage_in_bytes", "400\n");
        write(
            &root.path().join("memory"),
            "memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        assert_eq!(cgroup_room("4:memory:/job\n", root.path()), Some(600));
    }
}
