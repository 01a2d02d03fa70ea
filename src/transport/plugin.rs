//! NCCL net plugins (`NCCL_NET_PLUGIN`, `libnccl-net.so`): found, loaded and driven
//! (`net_plugin.rs` moves connections' slots through one).
//!
//! At the first communicator's init the plugin NCCL would load is looked for as NCCL does:
//! `NCCL_NET_PLUGIN=none` disables it; a name `X` is tried as `libnccl-net-X.so`, then as given
//! (a file name or path); unset, `libnccl-net.so`. A plugin named but not loadable is a WARN
//! naming it and the loader's reason, and the socket transport carries the data; so is a
//! plugin whose init fails, that has no device, or whose device cannot move host memory. A
//! plugin that loads (its `ncclNetPlugin_vN` symbol, v12 down to v6: `abi`) carries the data
//! between hosts, unless `NCCL_NET=Socket` asks for the socket transport. `NCCL_NET` naming
//! neither is a WARN.

pub(crate) mod abi;

use std::ffi::{c_char, CStr};

/// What the plugin lookup found, for messages and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    Disabled,
    /// Nothing at the default name (no message: most machines have no plugin).
    NoDefault,
    /// Named, but not loadable: (what was tried, why).
    NotLoadable(String, String),
    /// Loaded: (file, ABI version, the plugin's name, its table's address).
    Loaded(String, u32, String, usize),
    /// Loaded, but it exports no `ncclNetPlugin_v6` .. `_v12`.
    NoSymbol(String),
}

fn candidates(v: Option<&str>) -> Vec<String> {
    match v {
        None => vec!["libnccl-net.so".into()],
        Some(x) => vec![format!("libnccl-net-{x}.so"), x.to_string()],
    }
}

/// Looks for the plugin `NCCL_NET_PLUGIN` names (`value`).
pub fn find(value: Option<&str>) -> Found {
    if value.is_some_and(|v| v.eq_ignore_ascii_case("none")) {
        return Found::Disabled;
    }
    let mut last_err = String::new();
    for c in candidates(value) {
        // SAFETY: loading a plugin runs its initialisers, as NCCL's loading of it does.
        let lib = match unsafe { libloading::Library::new(&c) } {
            Ok(l) => l,
            Err(e) => {
                last_err = e.to_string();
                continue;
            }
        };
        for v in (6..=12).rev() {
            let sym = format!("ncclNetPlugin_v{v}\0");
            // SAFETY: every ncclNet_vN struct starts with `const char* name`; we read that
            // field only.
            let name = unsafe {
                lib.get::<*const *const c_char>(sym.as_bytes())
                    .ok()
                    .map(|s| *s)
                    .filter(|p| !p.is_null())
                    .map(|p| *p)
                    .filter(|n| !n.is_null())
                    .map(|n| CStr::from_ptr(n).to_string_lossy().into_owned())
            };
            if let Some(name) = name {
                // SAFETY: as above; the symbol's address only.
                let table = unsafe { lib.get::<*const u8>(sym.as_bytes()) }
                    .map(|s| *s as usize)
                    .unwrap_or(0);
                // The library stays loaded (as NCCL keeps its plugin): its table is ours now.
                std::mem::forget(lib);
                return Found::Loaded(c, v, name, table);
            }
        }
        return Found::NoSymbol(c);
    }
    match value {
        None => Found::NoDefault,
        Some(x) => Found::NotLoadable(candidates(Some(x)).join(", then "), last_err),
    }
}

/// Looks once per process and says what it found (at the first communicator's init).
pub fn check_once() {
    let _ = net();
}

/// The net plugin that carries data between hosts, if one was found, loaded and initialised
/// (once per process); None: the socket transport does.
pub(crate) fn net() -> Option<&'static abi::Net> {
    static NET: once_cell::sync::Lazy<Option<abi::Net>> = once_cell::sync::Lazy::new(load);
    NET.as_ref()
}

/// Whether a communicator moves data between hosts through the net plugin (else the socket
/// transport), by its `config.netName`, as NCCL picks a network: `NCCL_NET`, where set,
/// overrides it (see `load`); `Socket` is the socket transport; the loaded plugin's name (any
/// case) is the plugin; unset, the plugin where one is in use. Any other name is
/// ncclInvalidUsage naming what there is (NCCL fails such an init too).
pub fn uses_plugin(net_name: Option<&str>) -> crate::error::Result<bool> {
    let net = net();
    let Some(name) = net_name else {
        return Ok(net.is_some());
    };
    if let Some(env) = crate::param::get_str("NCCL_NET") {
        crate::debug::info(&format!(
            "Comm config netName {name} reset to NCCL_NET={env}"
        ));
        return Ok(net.is_some());
    }
    if name.eq_ignore_ascii_case("socket") {
        return Ok(false);
    }
    if net.is_some_and(|n| n.name.eq_ignore_ascii_case(name)) {
        return Ok(true);
    }
    Err(crate::error::Error::invalid_usage(format!(
        "config.netName {name:?}: no such network here (oxccl has Socket{})",
        net.map_or(String::new(), |n| format!(
            " and the net plugin '{}'",
            n.name
        ))
    )))
}

fn load() -> Option<abi::Net> {
    let value = crate::param::get_str("NCCL_NET_PLUGIN");
    let wanted = crate::param::get_str("NCCL_NET");
    let socket_wanted = wanted
        .as_deref()
        .is_some_and(|n| n.eq_ignore_ascii_case("socket"));
    let fallback = "using oxccl's socket transport";
    let net = match find(value.as_deref()) {
        Found::Disabled | Found::NoDefault => None,
        Found::NotLoadable(tried, why) => {
            crate::debug::warn(&format!(
                "NET/Plugin: NCCL_NET_PLUGIN={} could not be loaded (tried {tried}: {why}); \
                 {fallback}",
                value.clone().unwrap_or_default()
            ));
            None
        }
        Found::NoSymbol(file) => {
            crate::debug::warn(&format!(
                "NET/Plugin: {file} exports no ncclNetPlugin_v6 .. _v12; {fallback}"
            ));
            None
        }
        Found::Loaded(_, _, name, _) if socket_wanted => {
            crate::debug::info(&format!(
                "NET/Plugin: NCCL_NET=Socket: not using net plugin '{name}'"
            ));
            None
        }
        Found::Loaded(file, v, name, table) => match start(v, table) {
            Ok(net) => {
                crate::debug::info(&format!(
                    "NET/Plugin: loaded net plugin '{name}' (ncclNet_v{v}) from {file}"
                ));
                Some(net)
            }
            Err(e) => {
                crate::debug::warn(&format!(
                    "NET/Plugin: net plugin '{name}' (ncclNet_v{v}) from {file} cannot be used: \
                     {}; {fallback}",
                    e.msg
                ));
                None
            }
        },
    };
    if let Some(w) = wanted.filter(|w| !w.eq_ignore_ascii_case("socket")) {
        if !net
            .as_ref()
            .is_some_and(|n| n.name.eq_ignore_ascii_case(&w))
        {
            crate::debug::warn(&format!(
                "NCCL_NET={w}: no such network here (oxccl has Socket{}); using {}",
                net.as_ref()
                    .map_or(String::new(), |n| format!(" and {}", n.name)),
                net.as_ref().map_or("Socket", |n| n.name.as_str())
            ));
        }
    }
    net
}

/// Initialises a loaded plugin and checks that its first device moves host memory (v11+: in
/// a context finalized afterwards, whatever the checks found).
fn start(version: u32, table: usize) -> crate::error::Result<abi::Net> {
    use crate::error::Error;
    // SAFETY: `table` is the plugin's ncclNetPlugin_v<version>, kept loaded for the process.
    let mut net = unsafe { abi::Net::new(version, table as *const std::ffi::c_void) }?;
    net.init()?;
    let checked = net.devices().and_then(|n| {
        if n < 1 {
            return Err(Error::system("it has no device"));
        }
        if !net.moves_host_memory(0)? {
            return Err(Error::system(
                "its device 0 cannot move host memory (NCCL_PTR_HOST)",
            ));
        }
        Ok(())
    });
    net.end_probe();
    checked.map(|()| net)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plugins_are_found_or_named_with_the_reason() {
        assert_eq!(find(Some("none")), Found::Disabled);
        match find(Some("oxccl-test-no-such")) {
            Found::NotLoadable(tried, why) => {
                assert!(
                    tried.contains("libnccl-net-oxccl-test-no-such.so"),
                    "{tried}"
                );
                assert!(!why.is_empty());
            }
            f => panic!("{f:?}"),
        }
        // A library that loads but is no plugin (libc has no ncclNetPlugin_vN).
        assert_eq!(find(Some("libc.so.6")), Found::NoSymbol("libc.so.6".into()));
    }
}
