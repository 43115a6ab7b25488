package main

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// cpuSample is a reading of the machine's CPU counters (/proc/stat, in
// clock ticks) and of this process's CPU time.
type cpuSample struct {
	busy, total uint64
	self        time.Duration
	ok          bool
}

// readCPU reads the counters; ok is false where /proc/stat is missing.
func readCPU() cpuSample {
	var s cpuSample
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		s.self = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return s
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return s
	}
	for i, v := range f[1:] {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return s
		}
		if i >= 8 {
			break // guest time is counted in user time already
		}
		s.total += n
		if i != 3 && i != 4 { // idle, iowait
			s.busy += n
		}
	}
	s.ok = true
	return s
}

// cpuUse adds up the CPU of the periods it is given: the machine's
// cores kept busy (by every process) and this process's, in all.
type cpuUse struct {
	busy, total uint64
	self, wall  time.Duration
}

// add counts the period between samples a and b, wall long.
func (u *cpuUse) add(a, b cpuSample, wall time.Duration) {
	if !a.ok || !b.ok {
		return
	}
	u.busy += b.busy - a.busy
	u.total += b.total - a.total
	u.self += b.self - a.self
	u.wall += wall
}

// String is the average number of cores busy and used by this process,
// against the machine's cores.
func (u cpuUse) String() string {
	if u.total == 0 || u.wall <= 0 {
		return "CPU not measured"
	}
	cores := runtime.NumCPU()
	return fmt.Sprintf("CPU busy %.2f of %d cores, %.2f of them this process's",
		float64(u.busy)/float64(u.total)*float64(cores), cores, u.self.Seconds()/u.wall.Seconds())
}
