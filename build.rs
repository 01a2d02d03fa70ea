fn main() {
    // The shared object is what C programs load: give it NCCL's SONAME.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
    println!("cargo:rerun-if-changed=build.rs");
}
