//! What a reload changes, as pure rules: whether a running child must
//! restart (the one notion, from the arguments it runs with and those the
//! new config gives it) and whether a running plugin must be handed the new
//! placement (which it takes without a restart).

use crate::node::plugin::Placement;

use super::children::Args;

/// Why a child running with `old` must restart when the config now gives
/// it `new` (None: the config no longer calls for it); None when it keeps
/// running.
///
/// Each child's arguments say what restarts it in their `restart_key()`,
/// which takes them apart field by field: a field added to them does not
/// compile until it is sorted into "restarts the child" or "reaches the
/// running child otherwise".
pub(crate) fn restart(old: &Args, new: Option<&Args>) -> Option<&'static str> {
    let Some(new) = new else {
        return Some("disabled by reload");
    };
    let same = match (old, new) {
        (Args::Matcher(a), Args::Matcher(b)) => a.restart_key() == b.restart_key(),
        (Args::Plugin(a), Args::Plugin(b)) => a.restart_key() == b.restart_key(),
        (Args::Inventory(a), Args::Inventory(b)) => a.restart_key() == b.restart_key(),
        (Args::Watcher(a), Args::Watcher(b)) => a.restart_key() == b.restart_key(),
        (Args::Health(a), Args::Health(b)) => a.restart_key() == b.restart_key(),
        (Args::Enforcement(a), Args::Enforcement(b)) => a.restart_key() == b.restart_key(),
        (Args::Mps(a), Args::Mps(b)) => a.restart_key() == b.restart_key(),
        (Args::Usage(a), Args::Usage(b)) => a.restart_key() == b.restart_key(),
        (Args::Dra(a), Args::Dra(b)) => a.restart_key() == b.restart_key(),
        _ => false,
    };
    (!same).then_some(match new {
        Args::Watcher(_) => "directory changed",
        Args::Health(_) => "health settings changed",
        Args::Matcher(_)
        | Args::Plugin(_)
        | Args::Inventory(_)
        | Args::Enforcement(_)
        | Args::Mps(_)
        | Args::Usage(_)
        | Args::Dra(_) => "changed by reload",
    })
}

/// Whether a plugin placing with `old` must be handed `new`: switching
/// between IDs and the matcher, or a new matcher wait (which pairing hint
/// or matcher handle it holds is the supervisor's, the same either way).
pub(crate) fn repoint(old: &Placement, new: &Placement) -> bool {
    match (old, new) {
        (Placement::Ids(_), Placement::Ids(_)) => false,
        (Placement::Matcher { wait: a, .. }, Placement::Matcher { wait: b, .. }) => a != b,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::config::Config;
    use crate::node::health::HealthReport;
    use crate::node::kubelet_watch::CheckPlugins;
    use crate::node::matcher::MatcherHandle;
    use crate::node::metrics::Metrics;
    use crate::node::plugin::PairingBook;
    use crate::node::supervisor::children::{Child, ChildContext, wanted};
    use crate::rules::device::{Plan, Resource, discover};

    const NODE: &str = "node_name = \"node-1\"\nhttp_listen = \"\"\n";
    const GPUS: &str = "[devices]\nbackend = \"mock\"\n\
        [[devices.mock]]\nuuid = \"GPU-a\"\nmemory_mib = 1024\n\
        [[devices.mock]]\nuuid = \"GPU-b\"\nmemory_mib = 2048\n";

    /// Every child the config with `extra` calls for, with its arguments.
    fn children(extra: &str) -> BTreeMap<Child, Args> {
        let config = Config::parse(&format!("{NODE}{extra}\n{GPUS}"), None).unwrap();
        let plan = Plan::new(&config, discover(&config).unwrap()).unwrap();
        let placement = if config.pod_matching {
            Placement::Matcher {
                handle: MatcherHandle::default(),
                wait: Duration::from_millis(config.matcher.wait_ms),
            }
        } else {
            Placement::Ids(PairingBook::default())
        };
        let report_health: HealthReport = Arc::new(|_| {});
        let check_plugins: CheckPlugins = Arc::new(|| {});
        let context = ChildContext {
            metrics: &Arc::new(Metrics::default()),
            readiness: &Arc::default(),
            healthy: &vec![true; plan.gpus().len()].into(),
            placement,
            report_health: &report_health,
            check_plugins: &check_plugins,
        };
        let args = |c| Args::new(c, &config, &plan, &context).map(|a| (c, a));
        wanted(&config, &plan)
            .into_iter()
            .filter_map(args)
            .collect()
    }

    /// The running children of `old` that `new` restarts, with why.
    fn restarts(old: &str, new: &str) -> BTreeMap<Child, &'static str> {
        let (old, new) = (children(old), children(new));
        (old.iter())
            .filter_map(|(c, a)| Some((*c, restart(a, new.get(c))?)))
            .collect()
    }

    const MEMORY: Child = Child::Plugin(Resource::GpuMemory);
    const CORE: Child = Child::Plugin(Resource::GpuCore);

    #[test]
    fn the_same_config_restarts_nothing() {
        assert_eq!(restarts("", ""), BTreeMap::new());
        assert_eq!(
            restarts("pod_matching = false", "pod_matching = false"),
            BTreeMap::new()
        );
    }

    #[test]
    fn a_new_memory_unit_restarts_the_memory_plugin_and_the_matcher_only() {
        let old = "pod_matching = true";
        let new = "pod_matching = true\nmemory_unit_mib = 2";
        assert_eq!(
            restarts(old, new),
            BTreeMap::from([
                (Child::Matcher, "changed by reload"),
                (MEMORY, "changed by reload")
            ])
        );
    }

    #[test]
    fn cores_per_gpu_restarts_the_core_plugin() {
        let new = "pod_matching = false\ncores_per_gpu = 50";
        assert_eq!(
            restarts("pod_matching = false", new),
            BTreeMap::from([(CORE, "changed by reload")])
        );
    }

    #[test]
    fn a_dropped_resource_or_matching_is_disabled() {
        let new = "pod_matching = false\nresources = [\"gpu-memory\", \"gpu-count\"]";
        assert_eq!(
            restarts("", new),
            BTreeMap::from([
                (Child::Matcher, "disabled by reload"),
                (Child::Inventory, "disabled by reload"),
                (CORE, "disabled by reload"),
                (Child::Usage, "disabled by reload")
            ])
        );
    }

    #[test]
    fn usage_settings_restart_the_usage_monitor_only() {
        assert_eq!(
            restarts("", "[usage]\npoll_ms = 1000"),
            BTreeMap::from([(Child::Usage, "changed by reload")])
        );
        assert_eq!(
            restarts("", "[usage]\npoll_ms = 0"),
            BTreeMap::from([(Child::Usage, "disabled by reload")])
        );
    }

    #[test]
    fn a_new_directory_restarts_every_plugin_and_the_watcher() {
        let old = "pod_matching = false\ndevice_plugin_dir = \"/a\"";
        let new = "pod_matching = false\ndevice_plugin_dir = \"/b\"";
        let restarted = restarts(old, new);
        assert_eq!(restarted.len(), 4, "{restarted:?}");
        assert_eq!(restarted[&Child::Watcher], "directory changed");
        assert!(!restarted.contains_key(&Child::Health));
    }

    #[test]
    fn health_settings_restart_the_monitor_only() {
        let old = "pod_matching = false";
        for new in ["[health]\npoll_ms = 10", "[health]\nmock_dir = \"/flags\""] {
            assert_eq!(
                restarts(old, &format!("{old}\n{new}")),
                BTreeMap::from([(Child::Health, "health settings changed")]),
                "{new}"
            );
        }
    }

    #[test]
    fn new_credentials_restart_the_publisher_and_the_matcher_a_new_inventory_does_not() {
        let elsewhere = "[matcher]\nkubeconfig = \"/etc/other/kubeconfig\"";
        assert_eq!(
            restarts("", elsewhere),
            BTreeMap::from([
                (Child::Matcher, "changed by reload"),
                (Child::Inventory, "changed by reload")
            ])
        );
        // What the Node carries changes, and is sent to the running publisher.
        let (old, new) = (children(""), children("memory_unit_mib = 2"));
        let published = |c: &BTreeMap<Child, Args>| match &c[&Child::Inventory] {
            Args::Inventory(i) => i.published.clone(),
            _ => unreachable!("the publisher runs"),
        };
        assert_ne!(published(&old), published(&new));
        assert_eq!(
            restart(&old[&Child::Inventory], new.get(&Child::Inventory)),
            None
        );
    }

    #[test]
    fn the_sweeper_restarts_with_its_tick_its_enforcer_or_matching_only() {
        const ENFORCED: &str = "[enforcement]\nmode = \"hami-core\"";
        let on = format!("pod_matching = false\n{ENFORCED}");
        assert_eq!(restarts(&on, &on), BTreeMap::new());
        let polled = format!("pod_matching = false\n[health]\npoll_ms = 10\n{ENFORCED}");
        assert_eq!(
            restarts(&on, &polled),
            BTreeMap::from([
                (Child::Health, "health settings changed"),
                (Child::Enforcement, "changed by reload")
            ])
        );
        let moved = restarts(&on, &format!("{on}\nstate_dir = \"/elsewhere\""));
        assert_eq!(moved[&Child::Enforcement], "changed by reload");
        assert!(!moved.contains_key(&Child::Health), "{moved:?}");
        // Its metrics are the supervisor's; a new unit is nothing to it.
        let unit = restarts(&on, &format!("memory_unit_mib = 2\n{on}"));
        assert!(!unit.contains_key(&Child::Enforcement), "{unit:?}");
        assert_eq!(unit[&MEMORY], "changed by reload");
        // With pod matching it asks the matcher which containers live.
        assert_eq!(
            restarts(&on, ENFORCED)[&Child::Enforcement],
            "changed by reload"
        );
        assert_eq!(
            restarts(&on, "pod_matching = false")[&Child::Enforcement],
            "disabled by reload"
        );
    }

    #[test]
    fn mps_runs_with_its_backend_only_and_restarts_with_its_directories() {
        const HAMI: &str = "pod_matching = false\n[enforcement]\nmode = \"hami-core\"";
        let mps = format!("{HAMI}\ncompute = \"mps\"");
        assert!(!children(HAMI).contains_key(&Child::Mps));
        // HAMi-core for memory beside MPS: both run.
        let both = children(&mps);
        assert!(both.contains_key(&Child::Mps) && both.contains_key(&Child::Enforcement));
        // Switching back stops it; the plugins take the new enforcement
        // (as any enforcement change) by a restart.
        let back = restarts(&mps, HAMI);
        assert_eq!(back[&Child::Mps], "disabled by reload");
        assert_eq!(back[&MEMORY], "changed by reload");
        assert!(!back.contains_key(&Child::Health), "{back:?}");
        assert_eq!(restarts(&mps, &mps), BTreeMap::new());
        let moved = format!("{mps}\n[enforcement.mps]\npipe_dir = \"/run/elsewhere\"");
        assert_eq!(restarts(&mps, &moved)[&Child::Mps], "changed by reload");
        // MPS alone: no library to check, no sweeper.
        let alone = children("pod_matching = false\n[enforcement]\ncompute = \"mps\"");
        assert!(alone.contains_key(&Child::Mps) && !alone.contains_key(&Child::Enforcement));
    }

    #[test]
    fn a_new_matcher_wait_restarts_the_matcher_and_repoints_the_plugins() {
        let new = "[matcher]\nwait_ms = 100";
        assert_eq!(
            restarts("", new),
            BTreeMap::from([(Child::Matcher, "changed by reload")])
        );
        let placement = |extra| match children(extra).remove(&MEMORY) {
            Some(Args::Plugin(p)) => p.placement,
            _ => unreachable!("the memory plugin runs"),
        };
        let (ids, matcher) = (placement("pod_matching = false"), placement(""));
        assert!(repoint(&matcher, &placement(new)));
        assert!(repoint(&ids, &matcher) && repoint(&matcher, &ids));
        assert!(!repoint(&matcher, &placement("")));
        assert!(!repoint(&ids, &placement("pod_matching = false")));
    }
}
