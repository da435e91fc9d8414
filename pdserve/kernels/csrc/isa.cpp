// The CPU's features, and the tier that caps what the kernels use (isa.h).
#include "isa.h"

#include <atomic>

#if PDS_X86
#include <cpuid.h>
#elif PDS_ARM
#include <sys/auxv.h>
#endif

namespace pds {
namespace {

struct Tier {
  const char* name;
  uint32_t requires_;  // what the CPU must have for the tier to be offered
  uint32_t allows;  // what kernels may use under it (where the CPU has it)
};

#if PDS_X86
constexpr uint32_t kX2 = kAvx2, kX2V = kX2 | kAvxVnni, kX5 = kX2V | kAvx512 | kAvx512Vnni;
constexpr Tier kTiers[] = {
    {"scalar", 0, 0},
    {"avx2", kAvx2, kX2},
    {"avx2_vnni", kAvx2 | kAvxVnni, kX2V},
    {"avx512", kAvx2 | kAvx512, kX5},
    {"avx512_bf16", kAvx2 | kAvx512 | kAvx512Bf16, kX5 | kAvx512Bf16},
    {"amx", kAvx2 | kAvx512 | kAvx512Bf16 | kAmx, kX5 | kAvx512Bf16 | kAmx},
};
#elif PDS_ARM
constexpr uint32_t kNB = kNeon | kDotProd | kBf16 | kI8mm;
constexpr Tier kTiers[] = {
    {"scalar", 0, 0},
    {"neon", kNeon, kNeon},
    {"neon_dotprod", kNeon | kDotProd, kNeon | kDotProd},
    {"neon_bf16", kNeon | kBf16, kNB},
};
#else
constexpr Tier kTiers[] = {{"scalar", 0, 0}};
#endif
constexpr int kNumTiers = int(sizeof(kTiers) / sizeof(kTiers[0]));

#if PDS_X86
uint32_t detect() {
  uint32_t f = 0;
  unsigned a, b, c, d;
  // __builtin_cpu_supports also checks that the OS saves the AVX / AVX-512 state (XCR0)
  const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && ((c >> 29) & 1);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) f |= kAvx2;
  if ((f & kAvx2) && __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 4) & 1)) f |= kAvxVnni;
  if ((f & kAvx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    f |= kAvx512;
  if ((f & kAvx512) && __builtin_cpu_supports("avx512vnni")) f |= kAvx512Vnni;
  if ((f & kAvx512) && __builtin_cpu_supports("avx512bf16")) f |= kAvx512Bf16;
  if ((f & kAvx512Bf16) && __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1) && ((d >> 24) & 1) &&
      ((d >> 25) & 1) && __get_cpuid(1, &a, &b, &c, &d) && ((c >> 27) & 1)) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) == 3) f |= kAmx;  // XTILECFG and XTILEDATA enabled by the OS
  }
  return f;
}
#elif PDS_ARM
uint32_t detect() {
  // bits of AT_HWCAP / AT_HWCAP2 (linux/arch/arm64/include/uapi/asm/hwcap.h)
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  uint32_t f = 0;
  if (hw & (1ul << 1)) f |= kNeon;  // HWCAP_ASIMD
  if ((f & kNeon) && (hw & (1ul << 20))) f |= kDotProd;  // HWCAP_ASIMDDP
  if ((f & kNeon) && (hw2 & (1ul << 14))) f |= kBf16;  // HWCAP2_BF16
  if ((f & kNeon) && (hw2 & (1ul << 13))) f |= kI8mm;  // HWCAP2_I8MM
  if ((f & kNeon) && (hw & (1ul << 22))) f |= kSve;  // HWCAP_SVE
  return f;
}
#else
uint32_t detect() { return 0; }
#endif

int host_top() {
  const uint32_t f = cpu_features();
  int top = 0;
  for (int i = 0; i < kNumTiers; ++i)
    if ((kTiers[i].requires_ & f) == kTiers[i].requires_) top = i;
  return top;
}

std::atomic<uint32_t>& allowed() {
  static std::atomic<uint32_t> a{kTiers[host_top()].allows};
  return a;
}
std::atomic<int>& tier() {
  static std::atomic<int> t{host_top()};
  return t;
}

}  // namespace

uint32_t cpu_features() {
  static const uint32_t f = detect();
  return f;
}

bool isa_allows(uint32_t features) {
  return (cpu_features() & allowed().load(std::memory_order_relaxed) & features) == features;
}

std::string isa_tier() { return kTiers[tier().load()].name; }

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  const uint32_t f = cpu_features();
  for (const Tier& t : kTiers)
    if ((t.requires_ & f) == t.requires_) out.push_back(t.name);
  return out;
}

std::vector<std::string> feature_names(uint32_t features) {
  static const std::pair<uint32_t, const char*> names[] = {
      {kAvx2, "avx2+fma+f16c"}, {kAvxVnni, "avx_vnni"}, {kAvx512, "avx512f+bw+vl+dq"},
      {kAvx512Vnni, "avx512_vnni"}, {kAvx512Bf16, "avx512_bf16"}, {kAmx, "amx"}, {kNeon, "asimd"},
      {kDotProd, "asimddp"}, {kBf16, "bf16"}, {kI8mm, "i8mm"}, {kSve, "sve"}};
  std::vector<std::string> out;
  for (const auto& [bit, name] : names)
    if (features & bit) out.push_back(name);
  return out;
}

bool set_isa_tier(const std::string& name) {
  const uint32_t f = cpu_features();
  for (int i = 0; i < kNumTiers; ++i)
    if (name == kTiers[i].name && (kTiers[i].requires_ & f) == kTiers[i].requires_) {
      allowed().store(kTiers[i].allows);
      tier().store(i);
      return true;
    }
  return false;
}

}  // namespace pds
