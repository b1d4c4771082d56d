// The one-stage programs of umopt/search/bounds (untied.py, stage_cuts.py), compiled: two_chains (a stage's F and B
// chains over states (i forwarded, j backwarded)) and _suffix_work's loop (a stage's partition
// from its last chunk down, by the least tail of the suffix). The same moves in the same order as
// the Python there, which stays as the fallback; at S=8, B=256 they were 7 of the fast bound's
// 9 seconds, a numpy call per diagonal or sample over a few hundred cells.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace py = pybind11;

static constexpr int64_t BIG = std::numeric_limits<int64_t>::max() / 4;

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// t[i, j] as untied.two_chains; returns (t, reached).
static py::tuple two_chains(int64_t T, I64 Fs, I64 Gs, I64 rel, I64 ready, I64 after_f, I64 after_b, int64_t B) {
    const int64_t mx = Fs.shape(0) - 1;
    auto f = Fs.unchecked<1>();
    auto g = Gs.unchecked<1>();
    auto r = rel.unchecked<1>();
    auto q = ready.unchecked<1>();
    auto af = after_f.unchecked<1>();
    auto ab = after_b.unchecked<2>();
    I64 out({B + 1, B + 1});
    auto t = out.mutable_unchecked<2>();
    {
        py::gil_scoped_release nogil;
        for (int64_t i = 0; i <= B; ++i)
            for (int64_t j = 0; j <= B; ++j) t(i, j) = BIG;
        t(0, 0) = 0;
        for (int64_t d = 1; d <= 2 * B; ++d) {
            for (int64_t i = (d + 1) / 2; i <= std::min(d, B); ++i) {
                const int64_t j = d - i;
                int64_t best = BIG;
                // an F chunk of b samples ending at i, from (i - b, j), j <= i - b
                for (int64_t b = 1; b <= mx && i - b >= j; ++b) {
                    const int64_t prev = t(i - b, j);
                    if (prev >= BIG) continue;
                    const int64_t end = std::max(prev, r(i)) + f(b);
                    if (end + af(b) <= T) best = std::min(best, end);
                }
                // a B chunk of b samples ending at j, from (i, j - b)
                for (int64_t b = 1; b <= mx && b <= j; ++b) {
                    const int64_t prev = t(i, j - b);
                    if (prev >= BIG) continue;
                    const int64_t end = std::max(prev, q(j)) + g(b);
                    if (end + ab(b, j) <= T) best = std::min(best, end);
                }
                t(i, j) = best;
            }
        }
    }
    return py::make_tuple(out, t(B, B) < BIG);
}

// W[lo, l] as stage_cuts._suffix_work, from its inputs there; kg[lo] is added to every suffix from lo.
static I64 suffix_work(int64_t T, py::array_t<bool, py::array::c_style | py::array::forcecast> cut_ok, I64 rel, I64 own, I64 level_of,
                       I64 levels, I64 kg, int64_t B) {
    const int64_t mx = own.shape(0) - 1;
    const int64_t L = levels.shape(0);  // the last is "no chunk yet"
    auto ok = cut_ok.unchecked<2>();
    auto r = rel.unchecked<1>();
    auto w = own.unchecked<1>();
    auto lv = level_of.unchecked<1>();
    auto lev = levels.unchecked<1>();
    auto k = kg.unchecked<1>();
    I64 out({B + 1, L});
    auto W = out.mutable_unchecked<2>();
    {
        py::gil_scoped_release nogil;
        for (int64_t i = 0; i <= B; ++i)
            for (int64_t l = 0; l < L; ++l) W(i, l) = BIG;
        W(B, L - 1) = 0;
        for (int64_t lo = B - 1; lo >= 0; --lo) {
            for (int64_t b = 1; b <= std::min(mx, B - lo); ++b) {
                if (!ok(lo, b)) continue;
                const int64_t hi = lo + b;
                for (int64_t l = 0; l < L; ++l) {
                    if (W(hi, l) >= BIG) continue;
                    const int64_t rest = w(b) + W(hi, l);
                    const int64_t state = std::min(lv(b), l);
                    if (r(hi) + rest + lev(state) + k(lo) <= T) W(lo, state) = std::min(W(lo, state), rest);
                }
            }
        }
    }
    return out;
}

PYBIND11_MODULE(_stage_programs, m) {
    m.doc() = "umopt.search.bounds' one-stage programs, compiled";
    m.attr("VERSION") = 1;
    m.def("two_chains", &two_chains);
    m.def("suffix_work", &suffix_work);
}
