/* The logger oxccl gives net plugins (ncclDebugLogger_t). It is variadic, which stable Rust
 * cannot define: this formats the message as printf would and hands the text to the sink oxccl
 * set (transport::plugin::abi). Built by build.rs into a static library; its symbols stay
 * private to libnccl.so.2 (the library exports only NCCL's). */
#include <stdarg.h>
#include <stdio.h>

typedef void (*oxccl_log_sink)(int level, const char* file, int line, const char* text);
static oxccl_log_sink sink;

void oxccl_plugin_log_sink(oxccl_log_sink f) { sink = f; }

void oxccl_plugin_logger(int level, unsigned long flags, const char* file, int line,
                         const char* fmt, ...) {
  (void)flags;
  if (!fmt || !sink) return;
  char text[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  sink(level, file, line, text);
}
