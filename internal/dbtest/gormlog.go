package dbtest

import (
	"log"
	"time"

	"gorm.io/gorm/logger"
)

// Take returns what was written since the last Take and empties the
// buffer.
func (l *LogBuffer) Take() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.b.String()
	l.b.Reset()
	return s
}

// LogEverything returns a GORM logger writing to b at Info level with a
// slow threshold of 1ns: every statement it sees is printed, as "SLOW
// SQL", and every failure.
func LogEverything(b *LogBuffer) logger.Interface {
	return logger.New(log.New(b, "", 0), logger.Config{LogLevel: logger.Info, SlowThreshold: time.Nanosecond})
}
