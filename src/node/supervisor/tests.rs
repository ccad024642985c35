//! The supervisor in-process, on a mock config in a temporary directory with
//! the kubelet stand-in: which children a reload restarts and that a killed
//! child comes back, told by the children's actor ids and by what the
//! kubelet saw. Each test runs its own actor tree in this one process.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorCell, ActorId, ActorRef, call_t};

use super::children::Child;
use super::{Supervisor, SupervisorArgs, SupervisorMsg};
use crate::config::Config;
use crate::node::metrics::Metrics;
use crate::node::readiness::Readiness;
use crate::rules::device::Resource;
// The kubelet stand-in is reached through its socket directory, so no type
// of this crate crosses to the copy of it that gpu-sim links.
use gpu_sim::kubelet::{KubeletSim, ResourceView};

const WAIT: Duration = Duration::from_secs(20);
const MEMORY: Child = Child::Plugin(Resource::GpuMemory);
const CORE: Child = Child::Plugin(Resource::GpuCore);

fn config(dir: &Path, extra: &str) -> Config {
    let toml = format!(
        "device_plugin_dir = {:?}\npod_matching = false\nhttp_listen = \"\"\n{extra}\n\
         [devices]\nbackend = \"mock\"\n[[devices.mock]]\nuuid = \"GPU-a\"\nmemory_mib = 1024\n",
        dir.display().to_string()
    );
    Config::parse(&toml, None).unwrap()
}

struct Tree {
    supervisor: ActorRef<SupervisorMsg>,
    readiness: Arc<Readiness>,
    kubelet: KubeletSim,
    dir: tempfile::TempDir,
}

impl Tree {
    async fn start() -> Tree {
        Tree::start_with("").await
    }

    /// The tree on the mock config with `extra` keys.
    async fn start_with(extra: &str) -> Tree {
        let dir = tempfile::tempdir().unwrap();
        let kubelet = KubeletSim::start(dir.path()).unwrap();
        let config = config(dir.path(), extra);
        let plan = crate::node::app::plan(&config).await.unwrap();
        let metrics = Arc::new(Metrics::default());
        let readiness = Arc::new(Readiness::default());
        let args = SupervisorArgs {
            config,
            plan,
            metrics,
            readiness: readiness.clone(),
        };
        let (supervisor, _) = Actor::spawn(None, Supervisor, args).await.unwrap();
        let tree = Tree {
            supervisor,
            readiness,
            kubelet,
            dir,
        };
        tree.expect(&[
            ("gpu-memory", 1, 1024),
            ("gpu-core", 1, 100),
            ("gpu-count", 1, 1),
        ])
        .await;
        tree
    }

    /// Sends the supervisor a reload to the mock config with `extra` keys.
    async fn reload(&self, extra: &str) {
        let config = config(self.dir.path(), extra);
        let plan = crate::node::app::plan(&config).await.unwrap();
        let reload = SupervisorMsg::Reload {
            config: Box::new(config),
            plan,
        };
        self.supervisor.send_message(reload).unwrap();
    }

    async fn children(&self) -> BTreeMap<Child, ActorCell> {
        call_t!(
            self.supervisor,
            |reply| SupervisorMsg::Children { reply },
            5000
        )
        .unwrap()
    }

    async fn ids(&self) -> BTreeMap<Child, ActorId> {
        let children = self.children().await;
        children.into_iter().map(|(c, a)| (c, a.get_id())).collect()
    }

    /// Waits until the kubelet saw each `(resource, registrations, devices)`
    /// with its stream open.
    async fn expect(&self, want: &[(&str, u32, usize)]) {
        let seen = |s: &BTreeMap<String, ResourceView>| {
            want.iter().all(|(r, regs, devices)| {
                s.get(&format!("doslab.io/{r}")).is_some_and(|v| {
                    v.stream_open && v.registrations == *regs && v.devices == *devices
                })
            })
        };
        let ok = self.kubelet.wait_until(WAIT, seen).await;
        assert!(
            ok,
            "want {want:?}, kubelet saw {:#?}",
            self.kubelet.snapshot()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_restarts_exactly_the_children_it_changed() {
    let tree = Tree::start().await;
    let before = tree.ids().await;
    assert_eq!(before.len(), 5, "{before:?}");

    tree.reload("memory_unit_mib = 2").await;
    // Messages are handled in order: this answer comes after the reload.
    let after = tree.ids().await;

    let restarted: Vec<Child> = (before.iter())
        .filter(|(c, id)| after.get(c) != Some(id))
        .map(|(c, _)| *c)
        .collect();
    assert_eq!(restarted, [MEMORY]);
    assert_eq!(
        after.keys().collect::<Vec<_>>(),
        before.keys().collect::<Vec<_>>()
    );
    tree.expect(&[
        ("gpu-memory", 2, 512),
        ("gpu-core", 1, 100),
        ("gpu-count", 1, 1),
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_dropping_a_resource_stops_its_plugin_only() {
    let tree = Tree::start().await;
    let before = tree.ids().await;

    tree.reload("resources = [\"gpu-memory\", \"gpu-count\"]")
        .await;
    let after = tree.ids().await;

    let mut kept = before.clone();
    kept.remove(&CORE);
    assert_eq!(after, kept);
    let gone = |s: &BTreeMap<String, ResourceView>| {
        s.get("doslab.io/gpu-core")
            .is_some_and(|v| !v.stream_open && v.devices == 0)
    };
    assert!(tree.kubelet.wait_until(WAIT, gone).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_child_comes_back_and_the_others_run_on() {
    let tree = Tree::start().await;
    let before = tree.children().await;
    for child in [CORE, Child::Watcher, Child::Health] {
        before[&child].kill();
    }

    let deadline = tokio::time::Instant::now() + WAIT;
    let back = loop {
        let now = tree.ids().await;
        let back = [CORE, Child::Watcher, Child::Health]
            .iter()
            .all(|c| now.get(c).is_some_and(|id| *id != before[c].get_id()));
        if back || tokio::time::Instant::now() > deadline {
            break now;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    for (child, cell) in &before {
        let killed = [CORE, Child::Watcher, Child::Health].contains(child);
        assert_eq!(back.get(child) != Some(&cell.get_id()), killed, "{child}");
    }
    tree.expect(&[
        ("gpu-memory", 1, 1024),
        ("gpu-core", 2, 100),
        ("gpu-count", 1, 1),
    ])
    .await;
}

/// Polls `held` until `done` says so or [`WAIT`] runs out; the last look.
async fn readiness_until(tree: &Tree, done: impl Fn(&[String]) -> bool) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let held = tree.readiness.held();
        if done(&held) || tokio::time::Instant::now() > deadline {
            return held;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_dying_while_it_holds_readiness_back_leaves_it_to_the_supervisor() {
    // HAMi-core preloaded from a directory with no library: the sweeper
    // holds readiness back until one is installed.
    let empty = tempfile::tempdir().unwrap();
    let enforcing = format!(
        "[enforcement]\nmode = \"hami-core\"\nlibrary_dir = {:?}\nstate_dir = {:?}\n",
        empty.path().display().to_string(),
        empty.path().join("state").display().to_string(),
    );
    let tree = Tree::start_with(&enforcing).await;
    let sweeper = "enforcement sweeper: ";
    let held = readiness_until(&tree, |h| h.iter().any(|w| w.starts_with(sweeper))).await;
    assert!(held.iter().any(|w| w.starts_with(sweeper)), "{held:?}");

    // Killed, it never clears its own mark (no post_stop runs), and a
    // reload switching enforcement off does not start it again: only the
    // supervisor can clear the mark, and it must.
    tree.children().await[&Child::Enforcement].kill();
    tree.reload("").await;
    assert!(!tree.children().await.contains_key(&Child::Enforcement));
    let held = readiness_until(&tree, |h| h.is_empty()).await;
    assert!(held.is_empty(), "readiness stuck on a gone child: {held:?}");
}
