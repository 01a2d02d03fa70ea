//! NCCL net plugins (`NCCL_NET_PLUGIN`, `libnccl-net.so`): found and identified, not driven yet.
//!
//! At the first communicator's init the plugin NCCL would load is looked for as NCCL does:
//! `NCCL_NET_PLUGIN=none` disables it; a name `X` is tried as `libnccl-net-X.so`, then as given
//! (a file name or path); unset, `libnccl-net.so`. A plugin named but not loadable is a WARN
//! naming it and the loader's reason; a plugin that loads is identified (its `ncclNetPlugin_vN`
//! symbol, v12 down to v6, and the name in it) and a WARN says that oxccl moves data with its
//! own socket transport regardless: nothing is silently ignored. `NCCL_NET` naming a network
//! other than `Socket` is a WARN too.

use std::ffi::{c_char, CStr};

/// What the plugin lookup found, for messages and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    Disabled,
    /// Nothing at the default name (no message: most machines have no plugin).
    NoDefault,
    /// Named, but not loadable: (what was tried, why).
    NotLoadable(String, String),
    /// Loaded: (file, ABI version, the plugin's name).
    Loaded(String, u32, String),
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
                // The library stays loaded (as NCCL keeps its plugin): its name is ours now.
                std::mem::forget(lib);
                return Found::Loaded(c, v, name);
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
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        let value = crate::param::get_str("NCCL_NET_PLUGIN");
        match find(value.as_deref()) {
            Found::Disabled | Found::NoDefault => {}
            Found::NotLoadable(tried, why) => crate::debug::warn(&format!(
                "NET/Plugin: NCCL_NET_PLUGIN={} could not be loaded (tried {tried}: {why}); \
                 using oxccl's socket transport",
                value.unwrap_or_default()
            )),
            Found::NoSymbol(file) => crate::debug::warn(&format!(
                "NET/Plugin: {file} exports no ncclNetPlugin_v6 .. _v12; using oxccl's socket \
                 transport"
            )),
            Found::Loaded(file, v, name) => crate::debug::warn(&format!(
                "NET/Plugin: {file} is net plugin '{name}' (ncclNet_v{v}), but oxccl does not \
                 drive net plugins yet: data between hosts goes over its socket transport"
            )),
        }
        if let Some(net) = crate::param::get_str("NCCL_NET") {
            if !net.eq_ignore_ascii_case("socket") {
                crate::debug::warn(&format!(
                    "NCCL_NET={net}: oxccl's only network is Socket; using it"
                ));
            }
        }
    });
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
