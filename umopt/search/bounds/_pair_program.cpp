// The pair program's label search (umopt/search/bounds/pair_program.py), compiled.
//
// Python prepares everything that depends on T (usable chunks, releases, latest ends, ...) and
// hands it over as int64 arrays; this file only runs the dive and the program over states, the
// part that takes minutes in Python at B = 32. It mirrors pair_program.py move for move: the
// docstrings there are the description, and tests/test_solvers.py checks that both agree.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;
using i64 = std::int64_t;

namespace {

// a queue of messages: (first sample, arrival), both increasing
using Queue = std::vector<std::pair<int, i64>>;

// one op of a path, linked to the op before it (shared: labels that branch from one share its past)
struct Step {
    char kind;  // 'F' or 'B'
    int stage;  // 0: U, 1: W
    int lo, c;  // samples [lo, lo + c)
    i64 start;
    std::shared_ptr<const Step> prev;
};
using Path = std::shared_ptr<const Step>;

struct Label {
    i64 tU, tW;  // when each stage is free again
    Queue qa;    // activations on their way to W
    Queue qg;    // gradients on their way to U
    Path path;   // the ops that led here, only where a witness was asked for (Program::witness)
};

// a state: a, b, f, g, then what U owes, a 0 byte, what W owes (Program::push: sorted sizes or a count)
using Key = std::string;

i64 arrival(const Queue& q, int sample) {
    i64 when = 0;
    for (const auto& m : q) {
        if (m.first > sample) break;
        when = m.second;
    }
    return when;
}

Queue trim(const Queue& q, i64 free, int used) {
    size_t k = 0;
    while (k < q.size() && q[k].second <= free) ++k;
    while (k + 1 < q.size() && q[k + 1].first <= used) ++k;
    Queue out(q.begin() + static_cast<std::ptrdiff_t>(k), q.end());
    if (!out.empty() && out[0].first < used) out[0].first = used;
    return out;
}

bool no_later(const Label& x, const Label& y) {
    if (x.tU > y.tU || x.tW > y.tW) return false;
    for (const auto& m : x.qa)
        if (m.second > arrival(y.qa, m.first)) return false;
    for (const auto& m : x.qg)
        if (m.second > arrival(y.qg, m.first)) return false;
    return true;
}

struct State {
    int a, b, f, g;
    std::string pU, pW;  // what each stage owes, one byte a size (or the count)

    Key key() const {
        Key k;
        k.reserve(6 + pU.size() + pW.size());
        k.push_back(static_cast<char>(a));
        k.push_back(static_cast<char>(b));
        k.push_back(static_cast<char>(f));
        k.push_back(static_cast<char>(g));
        k += pU;
        k.push_back('\0');
        k += pW;
        return k;
    }
    static State of(const Key& k) {
        State s;
        s.a = static_cast<unsigned char>(k[0]);
        s.b = static_cast<unsigned char>(k[1]);
        s.f = static_cast<unsigned char>(k[2]);
        s.g = static_cast<unsigned char>(k[3]);
        size_t zero = k.find('\0', 4);
        s.pU = k.substr(4, zero - 4);
        s.pW = k.substr(zero + 1);
        return s;
    }
    int progress() const { return a + b + f + g; }
};

struct Program {
    i64 T;
    int B, mx;
    int tie[2];  // per stage: 0 untied, 1 each B op takes a forwarded size, 2 as many B as F ops
    std::vector<i64> kwork[2];  // [n * (B + 1) + m]: the least B work of m ops holding n samples
    std::vector<int> sizes[2][2][256];  // [stage][F=0/B=1][lo]: usable chunk sizes, ascending
    std::vector<i64> rel[2], ready[2], after_f[2], dur_f[2], dur_b[2], todo[2];
    std::vector<i64> after_b[2];  // [c * (B + 1) + n]
    std::vector<i64> latest[2];   // [i * (B + 1) + j]
    std::vector<i64> link;
    i64 last_tail[2];
    bool witness = false;  // keep each label's path (an allocation a move)

    Path step(const Label& l, char kind, int k, int lo, int c, i64 start) const {
        return witness ? std::make_shared<const Step>(Step{kind, k, lo, c, start, l.path}) : Path();
    }

    // the pending F ops: their sizes, sorted (tie 1), or how many there are (tie 2, "" for none)
    std::string push(int k, const std::string& p, int c) const {
        if (tie[k] == 0) return p;
        if (tie[k] == 2) return std::string(1, static_cast<char>(p.empty() ? 1 : p[0] + 1));
        std::string out = p;
        out.insert(std::upper_bound(out.begin(), out.end(), static_cast<char>(c)), static_cast<char>(c));
        return out;
    }
    bool has(int k, const std::string& p, int c) const {
        return tie[k] == 0 || (tie[k] == 2 ? !p.empty() : p.find(static_cast<char>(c)) != std::string::npos);
    }
    std::string pop(int k, const std::string& p, int c) const {
        if (tie[k] == 0) return p;
        if (tie[k] == 2) return p[0] == 1 ? std::string() : std::string(1, static_cast<char>(p[0] - 1));
        std::string out = p;
        out.erase(out.find(static_cast<char>(c)), 1);
        return out;
    }
    // can stage k still run what it owes (the pending F ops' B ops, holding ``open`` samples)
    // and the samples it has not forwarded, then the least tail, by T?
    bool fits(int k, i64 free, const std::string& p, int forwarded, int open) const {
        if (tie[k] == 0) return true;
        i64 owed = 0;
        if (tie[k] == 2)
            owed = kwork[k][open * (B + 1) + (p.empty() ? 0 : static_cast<unsigned char>(p[0]))];
        else
            for (char c : p) owed += dur_b[k][static_cast<unsigned char>(c)];
        return free + owed + todo[k][B - forwarded] + last_tail[k] <= T;
    }

    template <class Emit>
    void moves(const State& s, const Label& l, Emit emit) const {
        const int a = s.a, b = s.b, f = s.f, g = s.g;
        const int W1 = B + 1;
        if (l.tU > latest[0][a * W1 + b] || l.tW > latest[1][f * W1 + g]) return;
        if (a < B) {  // F on U: its activations join W's queue
            for (int c : sizes[0][0][a]) {
                i64 start = std::max(l.tU, rel[0][a + c]);
                i64 end = start + dur_f[0][c];
                if (end + after_f[0][c] > T) continue;
                i64 arrive = std::max(end, l.qa.empty() ? i64(0) : l.qa.back().second) + link[c];
                i64 nW = std::max(l.tW, start);
                std::string nU = push(0, s.pU, c);
                if (!fits(0, end, nU, a + c, a + c - b)) continue;
                Queue qa = l.qa;
                qa.emplace_back(a, arrive);
                emit(State{a + c, b, f, g, nU, s.pW}, Label{end, nW, trim(qa, nW, f), trim(l.qg, end, b), step(l, 'F', 0, a, c, start)});
            }
        }
        if (b < g) {  // B on U, after W's B of its samples
            for (int c : sizes[0][1][b]) {
                if (b + c > g) break;
                if (!has(0, s.pU, c)) continue;
                i64 start = std::max({l.tU, ready[0][b + c], arrival(l.qg, b + c - 1)});
                i64 end = start + dur_b[0][c];
                if (end + after_b[0][c * W1 + b + c] > T) continue;
                i64 nW = std::max(l.tW, start);
                std::string nU = pop(0, s.pU, c);
                if (!fits(0, end, nU, a, a - b - c)) continue;
                emit(State{a, b + c, f, g, nU, s.pW}, Label{end, nW, trim(l.qa, nW, f), trim(l.qg, end, b + c), step(l, 'B', 0, b, c, start)});
            }
        }
        if (f < a) {  // F on W, after U's F of its samples
            for (int c : sizes[1][0][f]) {
                if (f + c > a) break;
                i64 start = std::max({l.tW, rel[1][f + c], arrival(l.qa, f + c - 1)});
                i64 end = start + dur_f[1][c];
                if (end + after_f[1][c] > T) continue;
                i64 nU = std::max(l.tU, start);
                std::string nW = push(1, s.pW, c);
                if (!fits(1, end, nW, f + c, f + c - g)) continue;
                emit(State{a, b, f + c, g, s.pU, nW}, Label{nU, end, trim(l.qa, end, f + c), trim(l.qg, nU, b), step(l, 'F', 1, f, c, start)});
            }
        }
        if (g < f) {  // B on W: its gradients join U's queue
            for (int c : sizes[1][1][g]) {
                if (g + c > f) break;
                if (!has(1, s.pW, c)) continue;
                i64 start = std::max(l.tW, ready[1][g + c]);
                i64 end = start + dur_b[1][c];
                if (end + after_b[1][c * W1 + g + c] > T) continue;
                i64 arrive = std::max(end, l.qg.empty() ? i64(0) : l.qg.back().second) + link[c];
                i64 nU = std::max(l.tU, start);
                std::string nW = pop(1, s.pW, c);
                if (!fits(1, end, nW, f, f - g - c)) continue;
                Queue qg = l.qg;
                qg.emplace_back(g, arrive);
                emit(State{a, b, f, g + c, s.pU, nW}, Label{nU, end, trim(l.qa, end, f), trim(qg, nU, b), step(l, 'B', 1, g, c, start)});
            }
        }
    }
};

using Clock = std::chrono::steady_clock;

// 1: the end is reached, 0: it is not, -1: out of time, -2: more than max_labels labels held.
// Where the end is reached and P.witness is set, ``path`` is how (the last op first).
int run(const Program& P, int dive_states, double seconds, long max_labels, Path& path) {
    const bool timed = seconds >= 0;
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timed ? seconds : 0));
    const State start{0, 0, 0, 0, "", ""};
    const Key end_key = State{P.B, P.B, P.B, P.B, "", ""}.key();

    // the dive: depth first, the op that leaves both stages free earliest first
    std::unordered_map<Key, std::vector<Label>> dived;
    std::vector<std::pair<State, Label>> stack{{start, Label{0, 0, {}, {}}}};
    std::vector<std::pair<State, Label>> next;
    int count = 0;
    while (!stack.empty() && count < dive_states) {
        auto [s, l] = std::move(stack.back());
        stack.pop_back();
        Key k = s.key();
        if (k == end_key) {
            path = l.path;
            return 1;
        }
        auto& seen = dived[k];
        if (std::any_of(seen.begin(), seen.end(), [&](const Label& m) { return no_later(m, l); })) continue;
        ++count;
        next.clear();
        P.moves(s, l, [&](State&& ns, Label&& nl) { next.emplace_back(std::move(ns), std::move(nl)); });
        seen.push_back(std::move(l));
        // latest-free first into the stack, so the earliest-free comes off it next (stable, as Python's sort)
        std::stable_sort(next.begin(), next.end(), [](const auto& x, const auto& y) {
            return std::max(x.second.tU, x.second.tW) > std::max(y.second.tU, y.second.tW);
        });
        for (auto& m : next) stack.push_back(std::move(m));
    }
    if (stack.empty()) return 0;
    dived.clear();
    stack.clear();

    // the program, states by total progress a + b + f + g; a level is complete before it is run
    std::vector<std::unordered_map<Key, std::vector<Label>>> level(4 * P.B + 1);
    level[0][start.key()].push_back(Label{0, 0, {}, {}});
    long held = 1;  // labels in memory: a sized tie at B=32 makes millions a level
    auto add = [&](State&& s, Label&& l) {
        auto& front = level[s.progress()][s.key()];
        if (std::any_of(front.begin(), front.end(), [&](const Label& m) { return no_later(m, l); })) return;
        auto kept = std::remove_if(front.begin(), front.end(), [&](const Label& m) { return no_later(l, m); });
        held -= static_cast<long>(front.end() - kept) - 1;
        front.erase(kept, front.end());
        front.push_back(std::move(l));
    };
    long expanded = 0;
    for (int p = 0; p < 4 * P.B; ++p) {
        for (auto& [k, front] : level[p]) {
            const State s = State::of(k);
            for (const Label& l : front) {
                if (timed && (++expanded & 1023) == 0 && Clock::now() > deadline) return -1;
                if (held > max_labels) return -2;
                P.moves(s, l, add);
            }
            held -= static_cast<long>(front.size());
        }
        std::unordered_map<Key, std::vector<Label>>().swap(level[p]);  // free it
    }
    auto done = level[4 * P.B].find(end_key);
    if (done == level[4 * P.B].end()) return 0;
    path = done->second.front().path;
    return 1;
}

std::vector<i64> flat(const py::array_t<i64, py::array::c_style | py::array::forcecast>& x) {
    return std::vector<i64>(x.data(), x.data() + x.size());
}

}  // namespace

using Arr = py::array_t<i64, py::array::c_style | py::array::forcecast>;

// ``use``: (2, 2, B, mx + 1) 0/1, which chunk sizes each stage may use for F and B from each lo.
// The other arrays are per stage (first axis 2) as pair_program.py computes them. ``seconds`` < 0:
// no limit.
// With ``witness``, returns (answer, ops): the ops of one path to the end in start order, each
// (kind, stage 0/1, lo, size, start), empty unless the answer is 1; without it, the answer alone.
py::object feasible(i64 T, int B, int mx, int tie_u, int tie_w, Arr use, Arr rel, Arr ready, Arr after_f, Arr after_b, Arr latest, Arr dur_f, Arr dur_b,
                    Arr link, Arr todo, Arr owed, Arr last_tail, int dive_states, double seconds, long max_labels, bool witness) {
    if (B > 255 || mx > 255) throw std::invalid_argument("the compiled pair program takes B <= 255");
    Program P;
    P.T = T;
    P.B = B;
    P.mx = mx;
    P.tie[0] = tie_u;
    P.tie[1] = tie_w;
    auto u = use.unchecked<4>();
    for (int k = 0; k < 2; ++k)
        for (int kind = 0; kind < 2; ++kind)
            for (int lo = 0; lo < B; ++lo)
                for (int c = 1; c <= mx; ++c)
                    if (lo + c <= B && u(k, kind, lo, c)) P.sizes[k][kind][lo].push_back(c);
    auto rows = [](const Arr& x, int k) {
        auto v = flat(x);
        size_t n = v.size() / 2;
        return std::vector<i64>(v.begin() + static_cast<std::ptrdiff_t>(k * n), v.begin() + static_cast<std::ptrdiff_t>((k + 1) * n));
    };
    for (int k = 0; k < 2; ++k) {
        P.rel[k] = rows(rel, k);
        P.ready[k] = rows(ready, k);
        P.after_f[k] = rows(after_f, k);
        P.after_b[k] = rows(after_b, k);
        P.latest[k] = rows(latest, k);
        P.dur_f[k] = rows(dur_f, k);
        P.dur_b[k] = rows(dur_b, k);
        P.todo[k] = rows(todo, k);
        P.last_tail[k] = flat(last_tail)[k];
        P.kwork[k] = rows(owed, k);
    }
    P.link = flat(link);
    P.witness = witness;
    Path path;
    int met;
    {
        py::gil_scoped_release nogil;
        met = run(P, dive_states, seconds, max_labels, path);
    }
    if (!witness) return py::int_(met);
    std::vector<const Step*> back;  // the last op first
    for (const Step* st = path.get(); st; st = st->prev.get()) back.push_back(st);
    py::list ops;
    for (auto st = back.rbegin(); st != back.rend(); ++st)
        ops.append(py::make_tuple(std::string(1, (*st)->kind), (*st)->stage, (*st)->lo, (*st)->c, (*st)->start));
    return py::make_tuple(met, ops);
}

PYBIND11_MODULE(_pair_program, m) {
    m.doc() = "The pair program's label search, compiled (see umopt/search/bounds/pair_program.py).";
    // what pair_program.py expects of it (the arguments of feasible): an in-place build that
    // failed leaves an older module behind, which it must not call
    m.attr("VERSION") = 2;
    m.def("feasible", &feasible, py::arg("T"), py::arg("B"), py::arg("mx"), py::arg("tie_u"), py::arg("tie_w"), py::arg("use"), py::arg("rel"),
          py::arg("ready"), py::arg("after_f"), py::arg("after_b"), py::arg("latest"), py::arg("dur_f"), py::arg("dur_b"), py::arg("link"),
          py::arg("todo"), py::arg("owed"), py::arg("last_tail"), py::arg("dive_states"), py::arg("seconds"), py::arg("max_labels"),
          py::arg("witness") = false);
}
