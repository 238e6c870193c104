// The load client of bench/bench_router.py: N streamed HTTP requests read from one epoll loop.
//
//   stream_client PORT STREAMS STEADY_UNIX_S LAT_FILE < request
//
// Opens STREAMS loopback connections to PORT, writes the request read from stdin on each, then
// reads every connection until it closes. Each SSE token's text is the rank's send time
// ("text":"1712345678.123456 "); a token read once the wall clock is past STEADY_UNIX_S
// (every stream has started) adds (receive time - that time) to the latencies, written to
// LAT_FILE as native doubles (seconds). Prints "tokens seconds" on stdout. With
// STREAM_CLIENT_SPIN set it polls epoll without sleeping (a sender then never wakes it).
//
// In C++ so that reading 256 sockets a step costs the client a recv() each and little more:
// the Python epoll client spent ~10 us a socket (recv, regex, float, list), which on this
// 2-core machine put the client, not the router, at the end of the latency it measured.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static double now_s() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double mono_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static const char kKey[] = "\"text\":\"";

// Counts the tokens of the complete events in buf (up to its last "\n\n"), records their
// latencies if past steady, and drops what it scanned.
static long scan(std::string& buf, double now, double steady, std::vector<double>& lat) {
  size_t cut = buf.rfind("\n\n");
  if (cut == std::string::npos) return 0;
  long n = 0;
  size_t pos = 0;
  while ((pos = buf.find(kKey, pos)) != std::string::npos && pos < cut) {
    pos += sizeof(kKey) - 1;
    char* end = nullptr;
    double ts = strtod(buf.c_str() + pos, &end);
    if (end != buf.c_str() + pos && *end == ' ') {
      ++n;
      if (now > steady) lat.push_back(now - ts);
    }
  }
  buf.erase(0, cut);
  return n;
}

int main(int argc, char** argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s PORT STREAMS STEADY_UNIX_S LAT_FILE < request\n", argv[0]);
    return 2;
  }
  int port = atoi(argv[1]);
  int streams = atoi(argv[2]);
  double steady = atof(argv[3]);
  std::string request;
  char tmp[4096];
  size_t got;
  while ((got = fread(tmp, 1, sizeof(tmp), stdin)) > 0) request.append(tmp, got);

  int ep = epoll_create1(0);
  std::vector<std::string> bufs(streams);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  double t0 = mono_s();
  for (int i = 0; i < streams; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      perror("connect");
      return 1;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    for (size_t off = 0; off < request.size();) {
      ssize_t w = send(fd, request.data() + off, request.size() - off, MSG_NOSIGNAL);
      if (w <= 0) {
        perror("send");
        return 1;
      }
      off += w;
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = (static_cast<uint64_t>(i) << 32) | static_cast<uint32_t>(fd);
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
  }
  std::vector<double> lat;
  lat.reserve(1 << 20);
  long tokens = 0;
  int open_ = streams;
  std::vector<epoll_event> ready(streams);
  std::vector<char> rbuf(1 << 16);
  const bool spin = getenv("STREAM_CLIENT_SPIN") != nullptr;
  double idle_since = mono_s();
  while (open_ > 0) {
    int k = epoll_wait(ep, ready.data(), streams, spin ? 0 : 60000);
    if (k > 0) idle_since = mono_s();
    if (k == 0 && spin && mono_s() - idle_since < 60) continue;
    if (k == 0) {
      fprintf(stderr, "no data for 60 s\n");
      return 1;
    }
    if (k < 0) {
      if (errno == EINTR) continue;
      perror("epoll_wait");
      return 1;
    }
    for (int j = 0; j < k; ++j) {
      int fd = static_cast<int>(ready[j].data.u64 & 0xffffffffu);
      int idx = static_cast<int>(ready[j].data.u64 >> 32);
      ssize_t r = recv(fd, rbuf.data(), rbuf.size(), 0);
      double now = now_s();
      if (r <= 0) {
        epoll_ctl(ep, EPOLL_CTL_DEL, fd, nullptr);
        close(fd);
        --open_;
        continue;
      }
      bufs[idx].append(rbuf.data(), r);
      tokens += scan(bufs[idx], now, steady, lat);
    }
  }
  double dt = mono_s() - t0;
  FILE* f = fopen(argv[4], "wb");
  if (f == nullptr || fwrite(lat.data(), sizeof(double), lat.size(), f) != lat.size()) {
    perror("latency file");
    return 1;
  }
  fclose(f);
  printf("%ld %.6f\n", tokens, dt);
  return 0;
}
