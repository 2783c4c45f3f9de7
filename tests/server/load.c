/* The load generator of tests/test_server_load.py: load PORT CLIENTS ROUNDS GETS.
   CLIENTS threads, each on a connection of its own to memcached on 127.0.0.1:PORT, each
   ROUNDS times a `set` of one of its own keys (a value that names the client and the
   round) then GETS `get`s of it, one request in flight per connection, every reply
   checked byte for byte.  Prints "ok SETS GETS SECONDS", or the first wrong reply and
   exits 1. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int port, rounds, gets;
static volatile int failed;

static int reply(int fd, char *buf, size_t want)
{
    size_t got = 0;
    while (got < want) {
        ssize_t n = read(fd, buf + got, want - got);
        if (n <= 0)
            return -1;
        got += n;
    }
    buf[got] = 0;
    return 0;
}

static void *client(void *arg)
{
    long t = (long)arg;
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        perror("connect");
        failed = 1;
        return 0;
    }
    char req[256], want[256], got[256] = "", key[64], val[64];
    for (int i = 0; i < rounds && !failed; i++) {
        snprintf(key, sizeof key, "k%ld_%d", t, i % 97);
        snprintf(val, sizeof val, "v%ld_%d_%d", t, i, i * 7919);
        int n = snprintf(req, sizeof req, "set %s 0 0 %zu\r\n%s\r\n", key, strlen(val), val);
        if (write(fd, req, n) != n || reply(fd, got, 8) || strcmp(got, "STORED\r\n")) {
            fprintf(stderr, "client %ld set %d: %s\n", t, i, got);
            failed = 1;
            break;
        }
        n = snprintf(req, sizeof req, "get %s\r\n", key);
        int w = snprintf(want, sizeof want, "VALUE %s 0 %zu\r\n%s\r\nEND\r\n", key, strlen(val), val);
        for (int g = 0; g < gets; g++)
            if (write(fd, req, n) != n || reply(fd, got, w) || strcmp(got, want)) {
                fprintf(stderr, "client %ld get %d: %s\n", t, i, got);
                failed = 1;
                break;
            }
    }
    close(fd);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 5)
        return 2;
    port = atoi(argv[1]);
    int clients = atoi(argv[2]);
    rounds = atoi(argv[3]);
    gets = atoi(argv[4]);
    if (clients < 1 || clients > 256)
        return 2;
    pthread_t th[256];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long t = 0; t < clients; t++)
        pthread_create(&th[t], 0, client, (void *)t);
    for (int t = 0; t < clients; t++)
        pthread_join(th[t], 0);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (failed)
        return 1;
    printf("ok %ld %ld %.3f\n", (long)clients * rounds, (long)clients * rounds * gets,
           (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
    return 0;
}
