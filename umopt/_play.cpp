// Playing a population's 1F1B slots (umopt/vectorized.py, evaluate_1f1b), compiled.
//
// The same rules as the Python loop there, one individual at a time: every stage keeps a
// pointer to its next slot and runs it once the message it waits for has arrived (a ready time
// of +inf is "not yet"); an op ends at max(stage free, ready) + its cost, and its message leaves
// on its link once the op has ended and the link's previous message in that direction is through.
// Which stage moves first does not change any time (each depends only on its inputs), so a
// stage runs as many slots as are ready when visited. An individual whose pointers stop short of
// the end deadlocked; the caller sees that in the pointers.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace py = pybind11;

static py::tuple play(
    py::array_t<int64_t, py::array::c_style> src,    // (S, Q * P): where each slot's input time is
    py::array_t<double, py::array::c_style> cost,    // (S, Q * P): the op's duration
    py::array_t<uint8_t, py::array::c_style> is_f,   // (S, Q * P): F (1) or B (0)
    py::array_t<int64_t, py::array::c_style> dst,    // (S, Q * P): where its message's arrival goes
    py::array_t<double, py::array::c_style> msg,     // (S, Q * P): its message's transfer
    py::array_t<int64_t, py::array::c_style> nslots, // (S, P): real slots per stage and individual
    py::array_t<double, py::array::c_style> known,   // arrival times, +inf until sent (written)
    int64_t P, int64_t Q, int64_t last) {             // last: the last stage (its F ends are the arrivals)
    const int64_t S = nslots.shape(0);
    auto sr = src.unchecked<2>();
    auto co = cost.unchecked<2>();
    auto fk = is_f.unchecked<2>();
    auto ds = dst.unchecked<2>();
    auto ms = msg.unchecked<2>();
    auto ns = nslots.unchecked<2>();
    auto kn = known.mutable_unchecked<1>();
    py::array_t<double> clock_arr({S, P});
    py::array_t<int64_t> ptr_arr({S, P});
    auto clock = clock_arr.mutable_unchecked<2>();
    auto ptr = ptr_arr.mutable_unchecked<2>();
    const double inf = std::numeric_limits<double>::infinity();
    for (int64_t p = 0; p < P; ++p) {
        for (int64_t s = 0; s < S; ++s) {
            clock(s, p) = 0.0;
            ptr(s, p) = 0;
        }
    }
    {
        py::gil_scoped_release release;
        std::vector<double> f_free(S), b_free(S);
        for (int64_t p = 0; p < P; ++p) {
            std::fill(f_free.begin(), f_free.end(), 0.0);
            std::fill(b_free.begin(), b_free.end(), 0.0);
            for (int64_t round = 0, moved = 1; moved; ++round) {
                moved = 0;
                for (int64_t i = 0; i < S; ++i) {
                    const int64_t s = round % 2 == 0 ? i : S - 1 - i;
                    while (ptr(s, p) < ns(s, p)) {
                        const int64_t at = ptr(s, p) * P + p;
                        const double ready = kn(sr(s, at));
                        if (ready == inf) break;
                        const double end = std::max(clock(s, p), ready) + co(s, at);
                        clock(s, p) = end;
                        double value;
                        if (fk(s, at)) {
                            f_free[s] = std::max(f_free[s], end) + ms(s, at);
                            value = s == last ? end : f_free[s];
                        } else {
                            b_free[s] = std::max(b_free[s], end) + ms(s, at);
                            value = b_free[s];
                        }
                        kn(ds(s, at)) = value;
                        ptr(s, p) += 1;
                        moved = 1;
                    }
                }
            }
        }
    }
    return py::make_tuple(clock_arr, ptr_arr);
}

PYBIND11_MODULE(_play, m) {
    m.doc() = "umopt's 1F1B population scoring, the slot-playing loop compiled (see umopt/vectorized.py)";
    m.attr("VERSION") = 1;
    m.def("play", &play, py::arg("src"), py::arg("cost"), py::arg("is_f"), py::arg("dst"), py::arg("msg"), py::arg("nslots"), py::arg("known"),
          py::arg("P"), py::arg("Q"), py::arg("last"));
}
