// umopt/schedules/population_sim.py's evaluators compiled, one individual at a time: the same rules, the same
// floating-point operations in the same order (so the same scores to the bit; tested).
//
// evaluate_1f1b: the op order of every stage follows the numpy construction there, from the last stage up: a B
// chunk runs after the F op that completes both its own samples and what the stage below had
// forwarded when it ran that sample's B, and not before the stage's warm-up; F ops fill the other
// slots in order. Then the slots are played as the reference simulator plays ops: every stage
// keeps a pointer to its next slot and runs it once the message it waits for has arrived (+inf
// is "not yet"); an op ends at max(stage free, ready) + its cost, and its message leaves on its
// link once the op has ended and the link's previous message in that direction is through. Which
// stage moves first does not change any time (each depends only on its inputs), so a stage runs
// as many slots as are ready when visited. An individual whose pointers stop short of the end
// deadlocked and scores +inf. The numpy construction works on (slots x population) arrays and,
// with only its play loop compiled, was 97% of the call (S=8, B=256, a population of 60: 18 ms,
// the loop 0.3); this whole call takes about 1 ms there.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace py = pybind11;

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using F64 = py::array_t<double, py::array::c_style | py::array::forcecast>;

// a problem's cost tables (umopt.costmodel.CostTables), as both evaluators read them: a chunk's
// costs by its size, or (set_ranged) by its sample range (umopt.costmodel.RangeCosts: one
// minibatch of sequences of different lengths, (S, B+1, B+1) arrays indexed [s, lo, hi])
struct Costs {
    F64 fwd, bwd, link;  // (S, max size + 1); link (S - 1, max size + 1)
    const double *F, *G, *L;
    int64_t W, B;  // max size + 1; the minibatch
    std::vector<double> stat, stash, inb;  // per stage: static bytes, stash and input bytes per sample
    double optimizer_ms;
    bool recompute;
    bool ranged = false;
    F64 rfwd, rbwd, rlink, rbi, rbw;
    I64 rstash, rinputs;
    const double *RF = nullptr, *RG = nullptr, *RL = nullptr, *RBI = nullptr, *RBW = nullptr;
    const int64_t *RS = nullptr, *RI = nullptr;
    int64_t N = 0;  // B + 1
    Costs(F64 fwd_, F64 bwd_, F64 link_, F64 static_bytes, F64 stash_bytes, F64 input_bytes, double optimizer_ms_, bool recompute_, int64_t B_)
        : fwd(fwd_), bwd(bwd_), link(link_), F(fwd.data()), G(bwd.data()), L(link.data()), W(fwd.shape(1)), B(B_),
          stat(static_bytes.data(), static_bytes.data() + static_bytes.size()),
          stash(stash_bytes.data(), stash_bytes.data() + stash_bytes.size()),
          inb(input_bytes.data(), input_bytes.data() + input_bytes.size()), optimizer_ms(optimizer_ms_), recompute(recompute_) {}
    void set_ranged(F64 f, F64 g, F64 l, F64 bi, F64 bw, I64 st, I64 in) {
        rfwd = f, rbwd = g, rlink = l, rbi = bi, rbw = bw, rstash = st, rinputs = in;
        RF = rfwd.data(), RG = rbwd.data(), RL = rlink.data(), RS = rstash.data(), RI = rinputs.data();
        RBI = rbi.size() ? rbi.data() : nullptr;
        RBW = rbw.size() ? rbw.data() : nullptr;
        N = rfwd.shape(1);
        ranged = true;
    }
    // a chunk of `size` samples from `lo` on stage (link) s: by size, or by range
    int64_t at(int64_t s, int64_t lo, int64_t size) const { return (s * N + lo) * N + lo + size; }
    double f(int64_t s, int64_t lo, int64_t size) const { return ranged ? RF[at(s, lo, size)] : F[s * W + size]; }
    double g(int64_t s, int64_t lo, int64_t size) const { return ranged ? RG[at(s, lo, size)] : G[s * W + size]; }
    double l(int64_t s, int64_t lo, int64_t size) const { return ranged ? RL[at(s, lo, size)] : L[s * W + size]; }
    double gi(const double* Gi, int64_t s, int64_t lo, int64_t size) const { return ranged ? RBI[at(s, lo, size)] : Gi[s * W + size]; }
    double gw(const double* Gw, int64_t s, int64_t lo, int64_t size) const { return ranged ? RBW[at(s, lo, size)] : Gw[s * W + size]; }
    // by range only: the bytes a chunk keeps (recompute: its inputs) and its activations
    int64_t kept(int64_t s, int64_t lo, int64_t size) const { return (recompute ? RI : RS)[at(s, lo, size)]; }
    int64_t act(int64_t s, int64_t lo, int64_t size) const { return RS[at(s, lo, size)]; }
};

// what both return: iteration ms (P,), finish, busy ms and peak bytes (P, S)
struct Scores {
    py::array_t<double> it, finish, busy, peak;
    Scores(int64_t P, int64_t S) : it(P), finish({P, S}), busy({P, S}), peak({P, S}) {}
    py::tuple tuple() const { return py::make_tuple(it, finish, busy, peak); }
};

// one stage's partition of one individual
struct Part {
    std::vector<int64_t> size, last;  // per chunk: samples, last sample
    std::vector<int32_t> of;          // per sample: the chunk holding it
    int64_t lo(int64_t k) const { return last[k] - size[k] + 1; }
};

// fills p (reusing its storage: this runs for every stage of every individual)
static void fill_part(Part& p, const int64_t* sizes, int64_t K, int64_t B) {
    p.size.clear();
    p.last.clear();
    int64_t at = 0;
    for (int64_t k = 0; k < K && sizes[k] > 0; ++k) {
        p.size.push_back(sizes[k]);
        at += sizes[k];
        p.last.push_back(at - 1);
    }
    p.of.assign(B, 0);
    for (size_t k = 0, i = 0; k < p.size.size(); ++k)
        for (; i <= (size_t)p.last[k] && i < (size_t)B; ++i) p.of[i] = (int32_t)k;
}

// The state of playing one individual's slots: per stage, message arrivals (+inf: not yet; the
// last stage's act: its F ends), the next slot, the stage's clock and each link direction's.
struct Player {
    std::vector<std::vector<double>> act, grad;
    std::vector<int64_t> ptr;
    std::vector<double> clock, f_free, b_free;
    explicit Player(int64_t S) : act(S), grad(S), ptr(S), clock(S), f_free(S), b_free(S) {}

    // Plays slots (kind 0 F, 1 B, 2 W; chunk) as the reference simulator plays ops: every stage
    // runs its next slot once ready(s, kind, chunk) is known (+inf: a message not yet sent), an
    // op ends at max(stage free, ready) + dur(s, kind, chunk), and its message leaves once the
    // op has ended and the link's previous message that way is through. Which stage moves first
    // changes no time (each depends only on its inputs), so a stage runs every slot ready when
    // visited. Returns whether every stage ran all its slots (else the individual deadlocked).
    template <class Ready, class Dur>
    bool play(const std::vector<std::vector<int8_t>>& kind, const std::vector<std::vector<int32_t>>& chunk, const std::vector<Part>& fp,
              const std::vector<Part>& bp, const Costs& c, Ready ready, Dur dur) {
        const int64_t S = kind.size();
        const double inf = std::numeric_limits<double>::infinity();
        for (int64_t s = 0; s < S; ++s) {
            act[s].assign(fp[s].size.size(), inf);
            grad[s].assign(bp[s].size.size(), inf);
            ptr[s] = 0;
            clock[s] = f_free[s] = b_free[s] = 0.0;
        }
        for (int64_t round = 0, moved = 1; moved; ++round) {
            moved = 0;
            for (int64_t i = 0; i < S; ++i) {
                const int64_t s = round % 2 == 0 ? i : S - 1 - i;
                const int64_t Q = kind[s].size();
                while (ptr[s] < Q) {
                    const int64_t q = ptr[s], k = chunk[s][q];
                    const int8_t kd = kind[s][q];
                    const double at = ready(s, kd, k);
                    if (at == inf) break;
                    const double end = std::max(clock[s], at) + dur(s, kd, k);
                    clock[s] = end;
                    if (kd == 0) {
                        if (s == S - 1) {
                            act[s][k] = end;
                        } else {
                            f_free[s] = std::max(f_free[s], end) + c.l(s, fp[s].lo(k), fp[s].size[k]);
                            act[s][k] = f_free[s];
                        }
                    } else if (kd == 1 && s > 0) {
                        b_free[s] = std::max(b_free[s], end) + c.l(s - 1, bp[s].lo(k), bp[s].size[k]);
                        grad[s][k] = b_free[s];
                    }
                    ptr[s] += 1;
                    moved = 1;
                }
            }
        }
        bool settled = true;
        for (int64_t s = 0; s < S; ++s) settled = settled && ptr[s] == (int64_t)kind[s].size();
        return settled;
    }

    // each stage's end into finish(p, .), and the iteration (+inf where it deadlocked)
    template <class Finish, class It>
    void score(int64_t p, bool settled, double optimizer_ms, Finish& finish, It& it) const {
        double last_end = 0.0;
        for (size_t s = 0; s < clock.size(); ++s) {
            finish(p, s) = clock[s];
            last_end = std::max(last_end, clock[s]);
        }
        it(p) = settled ? last_end + optimizer_ms : std::numeric_limits<double>::infinity();
    }
};

// One stage's 1F1B order as slots (kind 0 F, 1 B; chunk index), for partitions f (forward) and b
// (backward), after the stage below (b_below, null on the last stage) whose B chunks had
// forwarded fwd_at_b_below samples when they ran; fills fwd_at_b for the stage above.
static void order_1f1b(const Part& f, const Part& b, const Part* b_below, int64_t warmup, int64_t B, std::vector<int64_t>& fwd_at_b_below,
                       std::vector<int64_t>& fwd_at_b, std::vector<int8_t>& kind, std::vector<int32_t>& chunk) {
    const int64_t n = f.size.size(), nb = b.size.size();
    const int64_t warm = std::min<int64_t>(warmup, n);
    std::vector<int64_t> after(nb);
    fwd_at_b.assign(nb, B);
    int64_t run = std::numeric_limits<int64_t>::min();
    for (int64_t j = 0; j < nb; ++j) {
        int64_t need = b.last[j] + 1;
        if (b_below != nullptr) need = std::max(need, fwd_at_b_below[b_below->of[b.last[j]]]);
        const int64_t own = f.of[std::min<int64_t>(need - 1, B - 1)];
        run = std::max(run, std::max(warm, own) - j);  // B_j runs after F number after_j
        after[j] = std::min(run + j, n - 1);
        fwd_at_b[j] = f.last[after[j]] + 1;
    }
    fwd_at_b_below.swap(fwd_at_b);
    const int64_t Q = n + nb;
    kind.assign(Q, 0);
    chunk.assign(Q, 0);
    for (int64_t j = 0; j < nb; ++j) {
        kind[after[j] + 1 + j] = 1;
        chunk[after[j] + 1 + j] = (int32_t)j;
    }
    for (int64_t q = 0, i = 0; q < Q; ++q)
        if (kind[q] == 0) chunk[q] = (int32_t)i++;
}

// individual p's forward and backward partitions of every stage
template <class Sizes>
static void fill_parts(std::vector<Part>& fp, std::vector<Part>& bp, const Sizes& fs, const Sizes& bs, int64_t p, int64_t K, int64_t B) {
    for (size_t s = 0; s < fp.size(); ++s) {
        fill_part(fp[s], &fs(p, s, 0), K, B);
        fill_part(bp[s], &bs(p, s, 0), K, B);
    }
}

static py::tuple evaluate_1f1b(I64 fsizes, I64 bsizes, I64 warmup, const Costs& c) {
    const int64_t P = fsizes.shape(0), S = fsizes.shape(1), K = fsizes.shape(2), B = c.B;
    auto fs = fsizes.unchecked<3>();
    auto bs = bsizes.unchecked<3>();
    auto wu = warmup.unchecked<2>();
    const bool recompute = c.recompute;
    Scores out(P, S);
    auto it = out.it.mutable_unchecked<1>();
    auto finish = out.finish.mutable_unchecked<2>();
    auto busy = out.busy.mutable_unchecked<2>();
    auto peak = out.peak.mutable_unchecked<2>();
    {
        py::gil_scoped_release release;
        std::vector<Part> fp(S), bp(S);
        std::vector<std::vector<int8_t>> kind(S);     // per slot: 0 F, 1 B
        std::vector<std::vector<int32_t>> chunk(S);   // per slot: its chunk
        std::vector<int64_t> fwd_at_b, fwd_at_b_below;
        Player pl(S);
        for (int64_t p = 0; p < P; ++p) {
            fill_parts(fp, bp, fs, bs, p, K, B);
            // --- the op order of every stage, from the last stage up
            for (int64_t s = S - 1; s >= 0; --s) {
                const Part &f = fp[s], &b = bp[s];
                const int64_t n = f.size.size(), nb = b.size.size();
                order_1f1b(f, b, s < S - 1 ? &bp[s + 1] : nullptr, wu(p, s), B, fwd_at_b_below, fwd_at_b, kind[s], chunk[s]);
                const int64_t Q = n + nb;
                int64_t held = 0, most = 0;
                double mem_most = 0.0;
                for (int64_t q = 0; q < Q; ++q) {
                    const int64_t k = chunk[s][q];
                    if (c.ranged) {  // each chunk's own bytes
                        const int64_t d = kind[s][q] == 0 ? c.kept(s, f.lo(k), f.size[k]) : -c.kept(s, b.lo(k), b.size[k]);
                        int64_t h = held + std::max<int64_t>(d, 0);
                        held += d;
                        if (recompute) h += kind[s][q] == 0 ? c.act(s, f.lo(k), f.size[k]) : c.act(s, b.lo(k), b.size[k]);
                        most = std::max(most, h);
                        continue;
                    }
                    const int64_t d = kind[s][q] == 0 ? f.size[k] : -b.size[k];
                    const int64_t h = held + std::max<int64_t>(d, 0);  // a B's samples are held while it runs
                    held += d;
                    if (recompute)  // inputs are held; activations only for the chunk that runs
                        mem_most = std::max(mem_most, (double)h * c.inb[s] + (double)std::abs(d) * c.stash[s]);
                    else
                        most = std::max(most, h);
                }
                peak(p, s) = c.ranged ? c.stat[s] + (double)most : c.stat[s] + (recompute ? mem_most : (double)most * c.stash[s]);
                double fwork = 0.0, bwork = 0.0;  // summed as numpy does: each kind, then both
                for (int64_t k = 0; k < n; ++k) fwork += c.f(s, f.lo(k), f.size[k]);
                for (int64_t k = 0; k < nb; ++k) bwork += c.g(s, b.lo(k), b.size[k]);
                busy(p, s) = fwork + bwork;
            }
            // --- playing the slots: F after the message holding its last sample; B (in sample
            // order) after the gradient message holding its last sample, on the last stage after
            // the F that forwarded it
            auto ready = [&](int64_t s, int8_t kd, int64_t k) {
                if (kd == 0) return s == 0 ? 0.0 : pl.act[s - 1][fp[s - 1].of[fp[s].last[k]]];
                if (s == S - 1) return pl.act[s][fp[s].of[bp[s].last[k]]];
                return pl.grad[s + 1][bp[s + 1].of[bp[s].last[k]]];
            };
            auto dur = [&](int64_t s, int8_t kd, int64_t k) {
                return kd == 0 ? c.f(s, fp[s].lo(k), fp[s].size[k]) : c.g(s, bp[s].lo(k), bp[s].size[k]);
            };
            pl.score(p, pl.play(kind, chunk, fp, bp, c, ready, dur), c.optimizer_ms, finish, it);
        }
    }
    return out.tuple();
}

// evaluate_gpipe for one individual at a time: F ops in sample order, each after the message
// holding its last sample; then B ops in reverse sample order after the stage's last F, each
// after the gradient message holding its first sample; messages one at a time per direction.
static py::tuple evaluate_gpipe(I64 fsizes, I64 bsizes, const Costs& c) {
    const int64_t P = fsizes.shape(0), S = fsizes.shape(1), K = fsizes.shape(2), B = c.B;
    auto fs = fsizes.unchecked<3>();
    auto bs = bsizes.unchecked<3>();
    const bool recompute = c.recompute;
    Scores out(P, S);
    auto it = out.it.mutable_unchecked<1>();
    auto finish = out.finish.mutable_unchecked<2>();
    auto busy = out.busy.mutable_unchecked<2>();
    auto peak = out.peak.mutable_unchecked<2>();
    {
        py::gil_scoped_release release;
        std::vector<Part> fp(S), bp(S);
        std::vector<double> fwd_end(S), arrive, arrive_next;
        for (int64_t p = 0; p < P; ++p) {
            fill_parts(fp, bp, fs, bs, p, K, B);
            for (int64_t s = 0; s < S; ++s) {  // forward sweep
                const Part& f = fp[s];
                const int64_t n = f.size.size();
                double end = 0.0, sent = 0.0, work = 0.0;
                arrive_next.assign(n, 0.0);
                for (int64_t k = 0; k < n; ++k) {
                    const double ready = s == 0 ? 0.0 : arrive[fp[s - 1].of[f.last[k]]];
                    const double d = c.f(s, f.lo(k), f.size[k]);
                    end = std::max(end, ready) + d;
                    work += d;
                    if (s + 1 < S) {
                        sent = std::max(sent, end) + c.l(s, f.lo(k), f.size[k]);
                        arrive_next[k] = sent;
                    }
                }
                fwd_end[s] = end;
                busy(p, s) = work;
                arrive.swap(arrive_next);
            }
            double last_end = 0.0;
            for (int64_t s = S - 1; s >= 0; --s) {  // backward sweep, chunks in reverse
                const Part& b = bp[s];
                const int64_t nb = b.size.size();
                double end = fwd_end[s], sent = 0.0, work = 0.0;
                for (int64_t k = 0; k < nb; ++k) work += c.g(s, b.lo(k), b.size[k]);  // summed in sample order, as numpy does
                arrive_next.assign(nb, 0.0);
                for (int64_t k = nb - 1; k >= 0; --k) {
                    const int64_t first = b.last[k] - b.size[k] + 1;
                    const double ready = s == S - 1 ? 0.0 : arrive[bp[s + 1].of[first]];
                    end = std::max(end, ready) + c.g(s, b.lo(k), b.size[k]);
                    if (s > 0) {
                        sent = std::max(sent, end) + c.l(s - 1, b.lo(k), b.size[k]);
                        arrive_next[k] = sent;
                    }
                }
                finish(p, s) = end;
                last_end = std::max(last_end, end);
                busy(p, s) += work;
                arrive.swap(arrive_next);
                // peak memory: everything is forwarded before the first B
                const Part& f = fp[s];
                if (c.ranged) {  // each chunk's own bytes
                    int64_t most = 0, run = 0;
                    if (!recompute) {
                        for (size_t k = 0; k < f.size.size(); ++k) most += c.act(s, f.lo(k), f.size[k]);
                    } else {
                        for (size_t k = 0; k < f.size.size(); ++k) {
                            run += c.kept(s, f.lo(k), f.size[k]);
                            most = std::max(most, run + c.act(s, f.lo(k), f.size[k]));
                        }
                        run = 0;
                        for (size_t k = 0; k < b.size.size(); ++k) {
                            run += c.kept(s, b.lo(k), b.size[k]);
                            most = std::max(most, run + c.act(s, b.lo(k), b.size[k]));
                        }
                    }
                    peak(p, s) = c.stat[s] + (double)most;
                } else if (!recompute) {
                    peak(p, s) = c.stat[s] + (double)B * c.stash[s];
                } else {  // inputs are held; activations only for the chunk that runs
                    double most = 0.0;
                    for (size_t k = 0; k < f.size.size(); ++k)
                        most = std::max(most, (double)(f.last[k] + 1) * c.inb[s] + (double)f.size[k] * c.stash[s]);
                    for (size_t k = 0; k < b.size.size(); ++k)
                        most = std::max(most, (double)(b.last[k] + 1) * c.inb[s] + (double)b.size[k] * c.stash[s]);
                    peak(p, s) = c.stat[s] + most;
                }
            }
            it(p) = last_end + c.optimizer_ms;
        }
    }
    return out.tuple();
}

// Both orders with each stage's backward split into B (input gradient) and W (weight gradient)
// ops: the F/B slots of the individual's order (onef1b: 1F1B with its warm-ups, else GPipe), then
// a W slot per B chunk placed as umopt.schedules.weights.with_weight_ops places it under the stage's cap
// (wcap < 0: the stage's backward stays whole). The slots are played as evaluate_1f1b plays them,
// each op waiting for every message that holds one of its samples (the latest), a W for nothing
// but its stage; memory follows umopt.costmodel.stage_peak_memory (a W releases what its samples
// kept). Equal to the reference simulator to 1e-9 (tested), not to the bit: busy time sums in op order.
static py::tuple evaluate_split(I64 fsizes, I64 bsizes, I64 warmup, I64 wcap, bool onef1b, const Costs& c, F64 bwd_input, F64 bwd_weight, F64 op_overhead) {
    const int64_t P = fsizes.shape(0), S = fsizes.shape(1), K = fsizes.shape(2), B = c.B;
    auto fs = fsizes.unchecked<3>();
    auto bs = bsizes.unchecked<3>();
    auto wu = warmup.unchecked<2>();
    auto wc = wcap.unchecked<2>();
    const double *Gi = bwd_input.data(), *Gw = bwd_weight.data(), *over = op_overhead.data();
    const bool recompute = c.recompute;
    Scores out(P, S);
    auto it = out.it.mutable_unchecked<1>();
    auto finish = out.finish.mutable_unchecked<2>();
    auto busy = out.busy.mutable_unchecked<2>();
    auto peak = out.peak.mutable_unchecked<2>();
    const double inf = std::numeric_limits<double>::infinity();
    {
        py::gil_scoped_release release;
        std::vector<Part> fp(S), bp(S);
        std::vector<int8_t> fb_kind;
        std::vector<int32_t> fb_chunk;
        std::vector<std::vector<int8_t>> kind(S);     // per slot: 0 F, 1 B, 2 W
        std::vector<std::vector<int32_t>> chunk(S);   // per slot: its chunk (a W: its B chunk)
        std::vector<int64_t> fwd_at_b, fwd_at_b_below, pending;
        Player pl(S);
        for (int64_t p = 0; p < P; ++p) {
            fill_parts(fp, bp, fs, bs, p, K, B);
            for (int64_t s = S - 1; s >= 0; --s) {
                const Part &f = fp[s], &b = bp[s];
                const int64_t n = f.size.size(), nb = b.size.size();
                if (onef1b) {
                    order_1f1b(f, b, s < S - 1 ? &bp[s + 1] : nullptr, wu(p, s), B, fwd_at_b_below, fwd_at_b, fb_kind, fb_chunk);
                } else {  // every F in sample order, then every B in reverse
                    fb_kind.assign(n, 0);
                    fb_chunk.resize(n);
                    for (int64_t k = 0; k < n; ++k) fb_chunk[k] = (int32_t)k;
                    for (int64_t k = nb - 1; k >= 0; --k) {
                        fb_kind.push_back(1);
                        fb_chunk.push_back((int32_t)k);
                    }
                }
                // W slots: before an F, the oldest pending W ops until its samples fit under the
                // cap; after a B, while more than the cap await; the rest at the end
                const int64_t cap = wc(p, s);
                kind[s].clear();
                chunk[s].clear();
                pending.clear();
                size_t head = 0;
                int64_t held = 0;
                auto pop_w = [&]() {
                    const int64_t j = pending[head++];
                    kind[s].push_back(2);
                    chunk[s].push_back((int32_t)j);
                    held -= b.size[j];
                };
                for (size_t q = 0; q < fb_kind.size(); ++q) {
                    const int64_t k = fb_chunk[q];
                    if (fb_kind[q] == 0 && cap >= 0) {
                        while (head < pending.size() && held + f.size[k] > cap) pop_w();
                        held += f.size[k];
                    }
                    kind[s].push_back(fb_kind[q]);
                    chunk[s].push_back((int32_t)k);
                    if (fb_kind[q] == 1 && cap >= 0) {
                        pending.push_back(k);
                        while (head < pending.size() && held > cap) pop_w();
                    }
                }
                while (head < pending.size()) pop_w();
                // peak memory (umopt.costmodel.stage_peak_memory)
                const bool split = cap >= 0 && nb > 0;
                const int8_t release = split ? 2 : 1;
                int64_t stashed = 0, awaiting = 0;
                double most = c.stat[s];
                for (size_t q = 0; q < kind[s].size(); ++q) {
                    const int8_t kd = kind[s][q];
                    const int64_t sz = kd == 0 ? f.size[chunk[s][q]] : b.size[chunk[s][q]];
                    if (c.ranged) {  // each chunk's own bytes (a W's: its B chunk's)
                        const int64_t k = chunk[s][q], lo = kd == 0 ? f.lo(k) : b.lo(k);
                        const int64_t kept = c.kept(s, lo, sz), act = c.act(s, lo, sz);
                        if (kd == 0) stashed += kept;
                        const double mem = c.stat[s] + (double)(recompute ? stashed + awaiting + (kd != 2 ? act : 0) : stashed);
                        most = std::max(most, mem);
                        if (kd == release) {
                            stashed -= kept;
                            if (kd == 2 && recompute) awaiting -= act;
                        } else if (kd == 1 && split && recompute) {
                            awaiting += act;
                        }
                        continue;
                    }
                    if (kd == 0) stashed += sz;
                    double mem;
                    if (recompute) {
                        const int64_t running = kd != 2 ? sz : 0;
                        mem = c.stat[s] + (double)stashed * c.inb[s] + (double)(awaiting + running) * c.stash[s];
                    } else {
                        mem = c.stat[s] + (double)stashed * c.stash[s];
                    }
                    most = std::max(most, mem);
                    if (kd == release) {
                        stashed -= sz;
                        if (kd == 2 && recompute) awaiting -= sz;
                    } else if (kd == 1 && split && recompute) {
                        awaiting += sz;
                    }
                }
                peak(p, s) = most;
            }
            // --- playing the slots: each op after the latest message holding one of its samples,
            // a W after nothing but its stage
            auto latest = [inf](const std::vector<double>& at, const Part& part, int64_t lo, int64_t hi) {
                double r = -inf;
                for (int64_t k = part.of[lo]; k <= part.of[hi]; ++k) r = std::max(r, at[k]);
                return r;
            };
            auto ready = [&](int64_t s, int8_t kd, int64_t k) {
                if (kd == 0) return s == 0 ? 0.0 : latest(pl.act[s - 1], fp[s - 1], fp[s].last[k] - fp[s].size[k] + 1, fp[s].last[k]);
                if (kd == 2) return 0.0;
                const int64_t lo = bp[s].last[k] - bp[s].size[k] + 1, hi = bp[s].last[k];
                return s == S - 1 ? latest(pl.act[s], fp[s], lo, hi) : latest(pl.grad[s + 1], bp[s + 1], lo, hi);
            };
            // a W: one B chunk's weight gradient as measured less the op's overhead, then the overhead
            auto dur = [&](int64_t s, int8_t kd, int64_t k) {
                const int64_t lo = kd == 0 ? fp[s].lo(k) : bp[s].lo(k), sz = kd == 0 ? fp[s].size[k] : bp[s].size[k];
                const double d = kd == 0 ? c.f(s, lo, sz)
                                 : kd == 1 ? (wc(p, s) >= 0 ? c.gi(Gi, s, lo, sz) : c.g(s, lo, sz))
                                           : (0.0 + (c.gw(Gw, s, lo, sz) - over[s])) + over[s];
                busy(p, s) += d;
                return d;
            };
            for (int64_t s = 0; s < S; ++s) busy(p, s) = 0.0;
            pl.score(p, pl.play(kind, chunk, fp, bp, c, ready, dur), c.optimizer_ms, finish, it);
        }
    }
    return out.tuple();
}

PYBIND11_MODULE(_population_sim, m) {
    m.doc() = "umopt's population scoring compiled (see umopt/schedules/population_sim.py)";
    m.attr("VERSION") = 3;
    py::class_<Costs>(m, "Costs")
        .def(py::init<F64, F64, F64, F64, F64, F64, double, bool, int64_t>())
        .def("set_ranged", &Costs::set_ranged);
    m.def("evaluate_gpipe", &evaluate_gpipe);
    m.def("evaluate_1f1b", &evaluate_1f1b);
    m.def("evaluate_split", &evaluate_split);
}
