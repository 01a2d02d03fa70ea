//! "Hosts" for multi-host tests on one machine: each a network namespace with its own mount
//! namespace (a private tmpfs on /dev/shm) and UTS namespace (its own hostname), joined to the
//! others by a veth pair into a bridge that lives in a namespace of its own. Ranks of one host
//! run under one `unshare`, so they share their host's /dev/shm. Everything is removed when the
//! `Hosts` is dropped (processes killed, namespaces and links deleted), also when a test fails.
//! Needs root; `Hosts::new` returns None (and says why) where namespaces cannot be made.

#![allow(dead_code)]

use std::process::{Child, Command, Stdio};

pub struct Hosts {
    tag: String,
    pub n: usize,
    kids: Vec<Child>,
}

fn sh(cmd: &str) -> Result<(), String> {
    let out = Command::new("sh")
        .args(["-c", cmd])
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Hosts {
    /// `n` hosts, 10.77.0.1 .. 10.77.0.n on interface `eth0` of each.
    pub fn new(n: usize) -> Option<Hosts> {
        // Unique among the test binary's threads too (tests run at once).
        static NEXT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 26;
        let tag = format!("ox{}{}", std::process::id() % 100_000, (b'a' + k) as char);
        let h = Hosts {
            tag: tag.clone(),
            n,
            kids: Vec::new(),
        };
        let br = h.bridge_ns();
        let mut steps = vec![
            format!("ip netns add {br}"),
            format!("ip -n {br} link add br0 type bridge"),
            format!("ip -n {br} link set br0 up"),
        ];
        for i in 0..n {
            let ns = h.ns(i);
            steps.extend([
                format!("ip netns add {ns}"),
                format!("ip -n {ns} link set lo up"),
                format!("ip link add {tag}h{i} type veth peer name {tag}b{i}"),
                format!("ip link set {tag}h{i} netns {ns}"),
                format!("ip -n {ns} link set {tag}h{i} name eth0"),
                format!("ip link set {tag}b{i} netns {br}"),
                format!("ip -n {br} link set {tag}b{i} master br0 up"),
                format!("ip -n {ns} addr add {}/24 dev eth0", h.ip(i)),
                format!("ip -n {ns} link set eth0 up"),
            ]);
        }
        for s in steps {
            if let Err(e) = sh(&s) {
                eprintln!("SKIPPED: cannot make network namespaces here ({e})");
                return None;
            }
        }
        Some(h)
    }

    fn bridge_ns(&self) -> String {
        format!("{}-br", self.tag)
    }

    pub fn ns(&self, i: usize) -> String {
        format!("{}-h{i}", self.tag)
    }

    pub fn ip(&self, i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// Starts `cmds` (one shell command per rank) on host `i`, in its namespaces, all under one
    /// `unshare` (they share the host's /dev/shm and hostname), with `env` set.
    pub fn start(&mut self, i: usize, env: &[(String, String)], cmds: &[String]) {
        let mut script = format!(
            "mount -t tmpfs tmpfs /dev/shm && hostname {}-host{i} || exit 97\n",
            self.tag
        );
        script.push_str("pids=\n");
        for c in cmds {
            script.push_str(&format!("( {c} ) & pids=\"$pids $!\"\n"));
        }
        // Every rank's status: the shell fails if any rank failed.
        script.push_str("rc=0; for p in $pids; do wait $p || rc=1; done; exit $rc\n");
        let kid = Command::new("ip")
            .args(["netns", "exec", &self.ns(i)])
            .args(["unshare", "--mount", "--uts", "--propagation", "private"])
            .args(["sh", "-c", &script])
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("ip netns exec");
        self.kids.push(kid);
    }

    /// Starts ranks 0..n of test `test` of this test binary, rank r on host `host_of(r)`
    /// with `OXCCL_TEST_RANK=r`, its output in `{path}.rank{r}.log` (`joined_logs`). Each rank
    /// runs on the host executor, finds the unique id in `path` (`id_via_file`), uses the
    /// hosts' `eth0` and waits 60 s at most (as `spawn_ranks`' ranks do); `env` adds to that,
    /// or overrides it.
    pub fn start_ranks(
        &mut self,
        test: &str,
        path: &str,
        n: usize,
        host_of: impl Fn(usize) -> usize,
        env: &[(&str, &str)],
    ) {
        let env: Vec<(String, String)> = [
            ("OXCCL_DEVICE", "host"),
            ("OXCCL_TEST_ID_FILE", path),
            ("NCCL_SOCKET_IFNAME", "eth0"),
            ("OXCCL_TIMEOUT_S", "60"),
        ]
        .iter()
        .chain(env)
        .map(|&(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let exe = std::env::current_exe().unwrap().display().to_string();
        for i in 0..self.n {
            let cmds: Vec<String> = (0..n)
                .filter(|&r| host_of(r) == i)
                .map(|r| {
                    format!(
                        "OXCCL_TEST_RANK={r} {exe} --exact {test} --nocapture \
                         > {path}.rank{r}.log 2>&1"
                    )
                })
                .collect();
            if !cmds.is_empty() {
                self.start(i, &env, &cmds);
            }
        }
    }

    /// Waits for every host's ranks; true when all succeeded.
    pub fn wait(&mut self) -> bool {
        let mut ok = true;
        for mut k in self.kids.drain(..) {
            ok &= k.wait().map(|s| s.success()).unwrap_or(false);
        }
        ok
    }

    /// Waits up to `limit` for every host's ranks: each host's success, in start order, or None
    /// if some did not end in time (they are killed).
    pub fn wait_for(&mut self, limit: std::time::Duration) -> Option<Vec<bool>> {
        let t0 = std::time::Instant::now();
        let mut done = vec![None; self.kids.len()];
        while done.iter().any(|d| d.is_none()) {
            for (k, d) in self.kids.iter_mut().zip(done.iter_mut()) {
                if d.is_none() {
                    if let Ok(Some(s)) = k.try_wait() {
                        *d = Some(s.success());
                    }
                }
            }
            if t0.elapsed() > limit {
                for k in &mut self.kids {
                    let _ = k.kill();
                    let _ = k.wait();
                }
                self.kids.clear();
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        self.kids.clear();
        Some(done.into_iter().map(|d| d == Some(true)).collect())
    }

    /// Every host's eth0 byte count (`bytes`), to compare with later (`assert_moved`).
    pub fn counters(&self) -> Vec<u64> {
        (0..self.n).map(|i| self.bytes(i)).collect()
    }

    /// Asserts that every host's link moved more than `min` bytes since `before`
    /// (`counters`): the data went over the network between the hosts.
    pub fn assert_moved(&self, before: &[u64], min: u64, what: &str) {
        for (i, b) in before.iter().enumerate() {
            let moved = self.bytes(i) - b;
            assert!(
                moved > min,
                "{what}: host {i}'s link moved only {moved} bytes"
            );
        }
    }

    /// Bytes host `i`'s eth0 has received and sent.
    pub fn bytes(&self, i: usize) -> u64 {
        self.stat(i, "bytes")
    }

    /// Packets host `i`'s eth0 has received and sent.
    pub fn packets(&self, i: usize) -> u64 {
        self.stat(i, "packets")
    }

    fn stat(&self, i: usize, what: &str) -> u64 {
        let read = |dir: &str| -> u64 {
            let out = Command::new("ip")
                .args(["netns", "exec", &self.ns(i), "cat"])
                .arg(format!("/sys/class/net/eth0/statistics/{dir}_{what}"))
                .output()
                .ok();
            out.and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
                .unwrap_or(0)
        };
        read("rx") + read("tx")
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for k in &mut self.kids {
            let _ = k.kill();
            let _ = k.wait();
        }
        for i in 0..self.n {
            let ns = self.ns(i);
            let _ = sh(&format!(
                "for p in $(ip netns pids {ns}); do kill -9 $p; done; ip netns del {ns}"
            ));
        }
        let _ = sh(&format!("ip netns del {}", self.bridge_ns()));
    }
}

/// Rank `r`'s unique id for a run whose ranks share only a filesystem: rank 0 makes it (on its
/// host's interface) and writes it to `path`; the others wait for the file.
pub fn id_via_file(path: &str, r: usize) -> [u8; nccl::api::UNIQUE_ID_BYTES] {
    if r == 0 {
        let id = nccl::api::get_unique_id().unwrap();
        let tmp = format!("{path}.tmp");
        std::fs::write(&tmp, id).unwrap();
        std::fs::rename(&tmp, path).unwrap();
        return id;
    }
    let t0 = std::time::Instant::now();
    loop {
        if let Some(id) = std::fs::read(path).ok().and_then(|b| b.try_into().ok()) {
            return id;
        }
        assert!(
            t0.elapsed().as_secs() < 60,
            "rank {r}: no unique id in {path}"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// In a rank process that `Hosts::start_ranks` started: its rank.
pub fn test_rank() -> usize {
    std::env::var("OXCCL_TEST_RANK").unwrap().parse().unwrap()
}

/// The logs of ranks 0..n (`take_logs`), each under a line "--- rank r:".
pub fn joined_logs(prefix: &str, n: usize) -> String {
    take_logs(prefix, n)
        .iter()
        .enumerate()
        .map(|(r, t)| format!("--- rank {r}:\n{t}"))
        .collect()
}

/// The logs `{prefix}.rank{r}.log` of ranks 0..n, removed once read.
pub fn take_logs(prefix: &str, n: usize) -> Vec<String> {
    (0..n)
        .map(|r| {
            let log = format!("{prefix}.rank{r}.log");
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let _ = std::fs::remove_file(&log);
            text
        })
        .collect()
}
