"""Hand-written `/proc/cpuinfo` texts of processors the project has run on or may run on.

Each keeps the fields a processor key reads (vendor, family, model number, model name, flags)
with the values public CPUID references give for that part, and a representative flags line:
the flags every x86-64 server has, plus what the generation adds. Two processors per text, as
the kernel prints them, so that a parser reading only the first block is exercised.
"""

from __future__ import annotations

# Flags of every x86-64 server CPU of the last decade (and of none of the keyed ones).
_BASE = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
    "sse sse2 ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology cpuid pni "
    "pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand "
    "lahf_lm abm 3dnowprefetch fsgsbase bmi1 smep bmi2 erms rdseed adx smap clflushopt "
    "xsaveopt xsavec xgetbv1"
)
_AMD = "mmxext fxsr_opt cmp_legacy cr8_legacy sse4a misalignsse osvw topoext sha_ni clzero"


def _cpuinfo(vendor: str, family: int, model: int, name: str, flags: str) -> str:
    """Two processor blocks of a cpuinfo text with these fields."""
    block = (
        "processor\t: {n}\n"
        f"vendor_id\t: {vendor}\n"
        f"cpu family\t: {family}\n"
        f"model\t\t: {model}\n"
        f"model name\t: {name}\n"
        "stepping\t: 1\n"
        "cpu MHz\t\t: 2400.000\n"
        f"flags\t\t: {flags}\n"
        "bogomips\t: 4800.00\n"
    )
    return block.format(n=0) + "\n" + block.format(n=1) + "\n"


# AMD EPYC 7601 (Zen 1, Naples): family 0x17, model 0x01; AVX2, no AVX-512.
ZEN1 = _cpuinfo("AuthenticAMD", 23, 1, "AMD EPYC 7601 32-Core Processor", f"{_BASE} {_AMD} avx2")
# AMD EPYC 7763 (Zen 3, Milan): family 0x19, model 0x01; AVX2, VAES, no AVX-512.
ZEN3 = _cpuinfo(
    "AuthenticAMD",
    25,
    1,
    "AMD EPYC 7763 64-Core Processor",
    f"{_BASE} {_AMD} avx2 vaes vpclmulqdq invpcid pku ospke",
)
_AVX512_ZEN4 = (
    "avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi "
    "avx512_vbmi2 gfni avx512_vnni avx512_bitalg avx512_vpopcntdq"
)
# AMD EPYC 9654 (Zen 4, Genoa): family 0x19 like Zen 3, model 0x11; AVX-512 with BF16 and VNNI.
ZEN4 = _cpuinfo(
    "AuthenticAMD",
    25,
    17,
    "AMD EPYC 9654 96-Core Processor",
    f"{_BASE} {_AMD} avx2 vaes vpclmulqdq {_AVX512_ZEN4}",
)
# AMD EPYC 9755 (Zen 5, Turin): family 0x1A, model 0x02; adds AVX-VNNI and VP2INTERSECT.
ZEN5 = _cpuinfo(
    "AuthenticAMD",
    26,
    2,
    "AMD EPYC 9755 128-Core Processor",
    f"{_BASE} {_AMD} avx2 vaes vpclmulqdq avx_vnni {_AVX512_ZEN4} avx512_vp2intersect "
    "movdiri movdir64b",
)
# Intel Xeon Platinum 8480+ (Sapphire Rapids): family 6, model 0x8F; AVX-512 FP16, AMX.
SAPPHIRE_RAPIDS = _cpuinfo(
    "GenuineIntel",
    6,
    143,
    "Intel(R) Xeon(R) Platinum 8480+",
    f"{_BASE} avx2 vaes vpclmulqdq avx_vnni {_AVX512_ZEN4} avx512_fp16 amx_bf16 amx_tile "
    "amx_int8 serialize tsxldtrk",
)
# AWS Graviton3 (Arm Neoverse V1): implementer 0x41 (Arm), part 0xd40; SVE, BF16, I8MM.
GRAVITON3 = (
    "processor\t: 0\n"
    "BogoMIPS\t: 2100.00\n"
    "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid "
    "asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc "
    "flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng\n"
    "CPU implementer\t: 0x41\n"
    "CPU architecture: 8\n"
    "CPU variant\t: 0x1\n"
    "CPU part\t: 0xd40\n"
    "CPU revision\t: 1\n"
)
# A cpuinfo that names no model number (some hypervisors and architectures).
NO_MODEL = "processor\t: 0\nvendor_id\t: SomeVendor\nmodel name\t: Virtual CPU\nflags\t\t: avx2\n"
