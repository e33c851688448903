/* A host clock set off by a number of seconds, for the sshd bed's clock-skew test
 * (tests/e2e/ssh/test_clock_skew_ssh.py), preloaded (LD_PRELOAD) into one bed host's SSH
 * sessions and the job's workers. The offset is read once from $HOME/clock-offset-s (0
 * without it): a bed host's sessions and the workers started there, whose environment is
 * cleaned but for HOME, have that host's HOME; the control host's has no such file.
 *
 * Only the wall clock moves (CLOCK_REALTIME and its coarse variant, gettimeofday, time):
 * that is what differs between two real hosts whose clocks disagree. Monotonic clocks, sleeps
 * and timed waits are the kernel's, untouched. Debian's libfaketime 0.9.10 was tried first
 * and cannot run a Python job: with its monotonic fake on, threading.Event().wait(0.3) never
 * returns; with it off (FAKETIME_DONT_FAKE_MONOTONIC=1), time.sleep raises EINVAL
 * (clock_nanosleep on CLOCK_MONOTONIC). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long long offset_ns(void)
{
    static int read;   /* a race between threads reads the same file twice: harmless */
    static long long ns;
    if (!read) {
        const char *home = getenv("HOME");
        char path[4096];
        if (home && snprintf(path, sizeof path, "%s/clock-offset-s", home) < (int)sizeof path) {
            FILE *f = fopen(path, "r");
            double s;
            if (f) {
                if (fscanf(f, "%lf", &s) == 1)
                    ns = (long long)(s * 1e9);
                fclose(f);
            }
        }
        read = 1;
    }
    return ns;
}

static void shift(struct timespec *ts)
{
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + offset_ns();
    ts->tv_sec = ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
    if (ts->tv_nsec < 0) {
        ts->tv_nsec += 1000000000LL;
        ts->tv_sec -= 1;
    }
}

int clock_gettime(clockid_t id, struct timespec *ts)
{
    static int (*real)(clockid_t, struct timespec *);
    if (!real)
        real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE))
        shift(ts);
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return -1;
    tv->tv_sec = ts.tv_sec;   /* glibc declares tv nonnull */
    tv->tv_usec = ts.tv_nsec / 1000;
    (void)tz;
    return 0;
}

time_t time(time_t *out)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
