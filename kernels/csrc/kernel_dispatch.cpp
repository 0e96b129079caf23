// Which kernels of cpu_kernels.h run: the widest instruction set this CPU has, unless
// `use_isa` picked a narrower one (tests and benchmarks run each one the CPU can); the Q8_0
// kernels with VNNI and the bf16 kernels with AVX512-BF16 only under avx512 on a CPU that
// has it.
#include <atomic>
#include <string_view>

#include "cpu_kernels.h"

namespace skiff_cpu {
namespace {

bool cpu_has(std::string_view name) {
  if (name == "avx512") return __builtin_cpu_supports("avx512f");
  if (name == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return false;
}

const char* widest() {
  for (const char* name : {"avx512", "avx2"})
    if (cpu_has(name)) return name;
  return "";
}

std::atomic<const char*> in_use{widest()};

bool has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
}

std::atomic<const char*> bf16_dot_pick{nullptr};  // use_bf16_dot_isa's, while isa() allows it

}  // namespace

const char* isa() { return in_use.load(); }

bool use_isa(const char* name) {
  for (const char* known : {"avx512", "avx2"})
    if (std::string_view(name) == known && cpu_has(known)) {
      in_use.store(known);
      return true;
    }
  return false;
}

const KernelTable& kernels() {
  return std::string_view(isa()) == "avx512" ? avx512::kernel_table : avx2::kernel_table;
}

const char* int8_dot_isa() {
  static const bool vnni = __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vnni");
  const std::string_view in = isa();
  if (in == "avx512" && vnni) return "avx512_vnni";
  return in.empty() ? "" : "avx2";
}

const Q8Kernels& q8_kernels() {
  return std::string_view(int8_dot_isa()) == "avx512_vnni" ? avx512_vnni::q8_kernels
                                                            : avx2::q8_kernels;
}

const char* bf16_dot_isa() {
  const std::string_view in = isa();
  const char* picked = bf16_dot_pick.load();
  if (picked != nullptr && (in == "avx512" || std::string_view(picked) == "avx2"))
    return picked;
  if (in == "avx512" && has_avx512_bf16()) return "avx512_bf16";
  return isa();
}

bool use_bf16_dot_isa(const char* name) {
  const std::string_view n = name;
  const bool ok = (n == "avx512_bf16" && has_avx512_bf16()) ||
                  ((n == "avx512" || n == "avx2") && cpu_has(n));
  if (!ok) return false;
  for (const char* known : {"avx512_bf16", "avx512", "avx2"})
    if (n == known) bf16_dot_pick.store(known);
  return true;
}

const Bf16Kernels& bf16_kernels() {
  const std::string_view in = bf16_dot_isa();
  if (in == "avx512_bf16") return avx512_bf16::bf16_kernels;
  return in == "avx512" ? avx512::bf16_kernels : avx2::bf16_kernels;
}

}  // namespace skiff_cpu
