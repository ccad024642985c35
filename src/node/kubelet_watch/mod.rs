//! Watches the device-plugin directory (notify/inotify) so that a kubelet
//! restart, which deletes every plugin socket and creates a new
//! `kubelet.sock`, or any removed socket, makes the plugins heal at once.
//! A timer catches what the filesystem events miss.

mod actor;

pub(crate) use actor::{CheckPlugins, KubeletWatcher, WatcherArgs};
