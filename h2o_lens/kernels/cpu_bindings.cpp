// The Python bindings of the fused CPU calls: decode_cpu.cpp's step, cold_cpu.cpp's refill and
// append (compiled as one unit, these files in that order; h2o_lens/kernels/cpu.py).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_step", &decode_step, "the fused H2O decode step of one layer on CPU");
  m.def("cold_refill", &cold_refill, "the cold tier's refill of one layer's recall window on CPU");
  m.def("cold_append", &cold_append, "a decode step's victims appended to one layer's cold store on CPU");
}
