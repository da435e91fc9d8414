// Which instruction sets the kernels may use: what the CPU reports, capped by a tier (tests and
// benchmarks force a lower one to run, on one host, the paths other hosts take).
//
// One build serves every host of an architecture: code that needs an extension carries a
// `target` attribute naming it (PDS_AVX2, PDS_AVX512, ...) and runs only after `use_*()` said the
// running CPU has it and the tier allows it. No torch headers here: the vector kernels include
// this file alone, and compile in seconds.
//
// Tiers, lowest first (the host's default is the highest it has):
//   x86-64:  scalar | avx2 (AVX2, FMA, F16C) | avx2_vnni (+ AVX-VNNI) | avx512 (F, BW, VL, DQ, and
//            AVX512-VNNI / AVX-VNNI where present) | avx512_bf16 | amx (AMX tiles)
//   aarch64: scalar | neon (Advanced SIMD) | neon_dotprod (+ SDOT/UDOT) | neon_bf16 (+ BFDOT, and
//            I8MM's USDOT where present)
// SVE is reported (cpu_features) but no kernel uses it: on the Arm server cores that have it
// (Neoverse V1: 2 x 256-bit SVE beside 4 x 128-bit NEON pipes; V2 / Grace: 128-bit SVE2) it
// gives no more multiply-adds per cycle than NEON does for these kernels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define PDS_X86 1
#define PDS_ARM 0
#define PDS_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PDS_AVX2_VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define PDS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2,f16c")))
#define PDS_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2")))
#define PDS_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,avx2")))
#elif defined(__aarch64__)
#define PDS_X86 0
#define PDS_ARM 1
#define PDS_NEON_DOT __attribute__((target("arch=armv8.2-a+dotprod")))
#define PDS_NEON_BF16 __attribute__((target("arch=armv8.2-a+bf16+dotprod")))
#define PDS_NEON_I8MM __attribute__((target("arch=armv8.2-a+i8mm+dotprod")))
#else
#define PDS_X86 0
#define PDS_ARM 0
#endif

// The 8-lane vector kernels (vec8.h): AVX2 on x86-64, two NEON registers on aarch64 (baseline).
#if PDS_X86
#define PDS_V8 PDS_AVX2
#define PDS_HAS_V8 1
#elif PDS_ARM
#define PDS_V8
#define PDS_HAS_V8 1
#else
#define PDS_HAS_V8 0
#endif

namespace pds {

enum Feature : uint32_t {
  kAvx2 = 1u << 0,  // with FMA and F16C
  kAvxVnni = 1u << 1,
  kAvx512 = 1u << 2,  // F, BW, VL, DQ
  kAvx512Vnni = 1u << 3,
  kAvx512Bf16 = 1u << 4,
  kAmx = 1u << 5,  // tiles, bf16 and int8, enabled by the OS
  kNeon = 1u << 8,
  kDotProd = 1u << 9,
  kBf16 = 1u << 10,
  kI8mm = 1u << 11,
  kSve = 1u << 12,  // detected and reported only
};

uint32_t cpu_features();  // what the running CPU (and OS) offer
bool isa_allows(uint32_t features);  // all of `features` are on the CPU and allowed by the tier
std::string isa_tier();  // the tier in force
std::vector<std::string> available_isas();  // the tiers this host can run, lowest first
std::vector<std::string> feature_names(uint32_t features);
// Cap the kernels at a tier of available_isas(); returns false (nothing changed) for another name.
bool set_isa_tier(const std::string& name);

inline bool use_avx2() { return isa_allows(kAvx2); }
inline bool use_avx_vnni() { return isa_allows(kAvx2 | kAvxVnni); }
inline bool use_avx512() { return isa_allows(kAvx512); }
inline bool use_avx512_vnni() { return isa_allows(kAvx512 | kAvx512Vnni); }
inline bool use_avx512_bf16() { return isa_allows(kAvx512 | kAvx512Bf16); }
inline bool use_amx_tiles() { return isa_allows(kAmx); }
inline bool use_neon() { return isa_allows(kNeon); }
inline bool use_dotprod() { return isa_allows(kNeon | kDotProd); }
inline bool use_bfdot() { return isa_allows(kNeon | kBf16); }
inline bool use_i8mm() { return isa_allows(kNeon | kI8mm); }
// the 8-lane kernels of vec8.h (AVX2 or NEON)
inline bool use_vec8() { return use_avx2() || use_neon(); }

}  // namespace pds
