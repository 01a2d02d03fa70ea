/* The logger oxccl gives net plugins (ncclDebugLogger_t). It is variadic, which stable Rust
 * cannot define: this formats the message as printf would and hands the text to the sink oxccl
 * set (transport::plugin::abi). Built by build.rs into a static library; its symbols stay
 * private to libnccl.so.2 (the library exports only NCCL's). */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>

typedef void (*oxccl_log_sink)(int level, const char* file, int line, const char* text);
/* Set before a plugin's init, read from any of its threads. */
static _Atomic(oxccl_log_sink) sink;

void oxccl_plugin_log_sink(oxccl_log_sink f) { atomic_store_explicit(&sink, f, memory_order_release); }

void oxccl_plugin_logger(int level, unsigned long flags, const char* file, int line,
                         const char* fmt, ...) {
  (void)flags;
  oxccl_log_sink to = atomic_load_explicit(&sink, memory_order_acquire);
  if (!fmt || !to) return;
  char text[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  to(level, file, line, text);
}
