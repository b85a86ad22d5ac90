// The whole kernel library as one translation unit: torch's headers, which take most of a kernel's compile time,
// are read once for all of them, and the library is built once per CPU kind (compile.py) when the package is.
// Each kernel keeps its own file, its own namespace and its torch reference (see each file's head).
#include "greedy.cpp"
#include "int4_gemm.cpp"
#include "int8_gemm.cpp"
#include "kv_quant.cpp"
#include "paged_attention.cpp"
#include "prefill_attention.cpp"
#include "rms_norm.cpp"
#include "rotary.cpp"
#include "silu_mul.cpp"
#include "small_gemm.cpp"
// Last: it calls the kernels above.
#include "decode_stack.cpp"
