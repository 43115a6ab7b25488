package relay

// ReleaseReasons exports releaseReasons to the tests.
var ReleaseReasons = releaseReasons
