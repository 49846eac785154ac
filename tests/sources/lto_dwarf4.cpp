#include <map>
#include <vector>
#include <string>
#include <algorithm>
#include <functional>
#include <memory>
#include <cstdio>
#include <numeric>
namespace app {
template <typename T> struct Box { T v; explicit Box(T x) : v(x) {} T get() const { return v * 2; } };
template <typename K, typename V> class Table {
  std::map<K, std::vector<V>> m;
public:
  void add(const K& k, V v) { m[k].push_back(v); }
  V total() const { V s{}; for (auto& [k, vs] : m) s = std::accumulate(vs.begin(), vs.end(), s); return s; }
  template <typename F> void each(F f) const { for (auto& [k, vs] : m) for (auto& v : vs) f(k, v); }
};
struct Shape { virtual ~Shape() = default; virtual double area() const = 0; };
struct Sq : Shape { double s; explicit Sq(double x) : s(x) {} double area() const override { return s * s; } };
struct Ci : Shape { double r; explicit Ci(double x) : r(x) {} double area() const override { return 3.14159 * r * r; } };
}
int main(int argc, char** argv) {
  app::Table<std::string, long> t;
  for (int i = 0; i < argc * 100; ++i) t.add(std::to_string(i % 7), app::Box<long>(i).get());
  std::vector<std::unique_ptr<app::Shape>> shapes;
  for (int i = 0; i < argc * 10; ++i) { if (i % 2) shapes.push_back(std::make_unique<app::Sq>(i)); else shapes.push_back(std::make_unique<app::Ci>(i)); }
  std::sort(shapes.begin(), shapes.end(), [](auto& a, auto& b) { return a->area() < b->area(); });
  double s = 0; for (auto& p : shapes) s += p->area();
  long n = 0; t.each([&](const std::string& k, long v) { n += v + (long)k.size(); });
  std::function<long(long)> f = [&](long x) { return x + n; };
  std::printf("%ld %f %ld\n", t.total(), s, f(argc));
  return 0;
}
